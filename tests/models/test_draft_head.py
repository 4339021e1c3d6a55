"""The SmolLM2 draft head (models/smollm2-draft-head, trained by tools/train_draft_head.py) on its
target: small, tied to the target's weights, exact, and accepted often enough to matter.

Runs when the target is in the cache (``python -m tools.fetch_model smollm2-135m-instruct``)."""
from __future__ import annotations

import dataclasses

import pytest

from bench import prompts_spec
from kvwire import LLM, SamplingParams
from kvwire.model import registry
from kvwire.model.draft_head import WEIGHTS_FILE, shipped_head

NAME = "smollm2-135m-instruct"
HEAD = shipped_head(NAME)
pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not registry.is_cached(NAME),
                                 reason=f"{NAME} is not fetched (python -m tools.fetch_model {NAME})"),
              pytest.mark.skipif(HEAD is None, reason="no draft head in models/ (python -m tools.train_draft_head)")]


def test_the_head_is_small_and_loads_for_its_target():
    assert (HEAD / WEIGHTS_FILE).stat().st_size <= 50 * 1000 * 1000
    llm = LLM(NAME, num_pages=64, draft_model=HEAD)
    assert llm.core.draft.head is not None


def test_the_head_is_exact_and_accepted_on_chat():
    """Greedy output equals plain greedy on chat prompts, and the head's proposals are accepted at
    a rate no untrained or mis-wired head reaches (a random one: ~0)."""
    llm = LLM(NAME, num_pages=512, draft_model=HEAD, speculative_auto_off=False)
    llm.core.spec_cfg = dataclasses.replace(llm.core.spec_cfg, greedy_max_batch=0)
    prompts = [prompts_spec.encode(llm.tokenizer, t) for t in prompts_spec.chat(4)]
    plain = llm.generate(prompts, SamplingParams(max_tokens=32, speculative="none"))
    reqs = [llm.core.requests[llm.add_request(p, SamplingParams(max_tokens=32, speculative="draft"))]
            for p in prompts]
    while llm.has_unfinished():
        llm.step()
    assert [r.output_ids for r in reqs] == [o.token_ids for o in plain]
    drafted, accepted = sum(r.spec.drafted for r in reqs), sum(r.spec.accepted for r in reqs)
    assert drafted > 0 and accepted / drafted > 0.2, (accepted, drafted)  # 21 / 53 when it was trained
