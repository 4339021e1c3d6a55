"""Penalties, logit_bias, min_tokens and min_p through the engine: batched with plain requests, the
one-sequence reference's tokens (kvwire.generate, which processes row by row), speculative decoding
still exact, preemption and replay giving the same tokens."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvwire import LLM, SamplingParams
from kvwire.engine.request import Request
from kvwire.logits_process import RowContext, apply
from kvwire.generate import generate
from kvwire.runtime import EngineConfig, load_engine
from kvwire.spec.proposer import Proposal
from kvwire.spec.step import processed
from tests.decode_svc.harness import tiny_model

PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 31)] + [[40, 41, 42] * 9, [7, 8] * 12]
CONTROLS = [dict(repetition_penalty=1.4), dict(presence_penalty=1.0, frequency_penalty=0.5),
            dict(frequency_penalty=-1.5), dict(logit_bias={17: 4.0, 40: -100}), dict(min_p=0.2, temperature=1.0)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def reference(model_dir):
    eng = load_engine(EngineConfig(model_dir=model_dir, weights="none"))
    return lambda prompt, params: generate(eng.model, prompt, params, cache=eng.new_cache(64))


def test_batched_with_plain_requests_each_gets_the_reference_tokens(model_dir, reference):
    params = [SamplingParams(max_tokens=16, ignore_eos=True, seed=i, **c) for i, c in enumerate(CONTROLS)]
    plain = SamplingParams(max_tokens=16, ignore_eos=True)
    llm = LLM(model_dir, num_pages=128, weights="none")
    outs = llm.generate(PROMPTS + PROMPTS, params + [plain] * len(PROMPTS))
    for prompt, p, out in zip(PROMPTS + PROMPTS, params + [plain] * len(PROMPTS), outs):
        assert out.token_ids == reference(prompt, p)
    processed = [o.token_ids for o in outs[:len(PROMPTS)]]
    assert processed != [o.token_ids for o in outs[len(PROMPTS):]]  # the controls changed something
    assert 17 in processed[3] and 40 not in processed[3]


def test_min_tokens_holds_stop_tokens_back(model_dir, reference):
    llm = LLM(model_dir, num_pages=64, weights="none")
    free = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    stop = free[1]  # the second token plain decoding emits: it would end the request there
    ended = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=12, stop_token_ids=[stop]))[0]
    assert ended.token_ids == free[:2]
    held = SamplingParams(max_tokens=12, stop_token_ids=[stop], min_tokens=6)
    out = llm.generate([PROMPTS[1]], held)[0].token_ids
    assert stop not in out[:6] and len(out) >= 6
    assert out == reference(PROMPTS[1], held)


def test_speculative_greedy_with_penalties_equals_plain(model_dir):
    """Each verification row is processed with its own history (the proposals before it), so n-gram
    speculation gives plain decoding's tokens, proposals being made and some accepted on the way."""
    llm = LLM(model_dir, num_pages=128, weights="none", speculative="ngram", num_speculative_tokens=4)
    cfg = llm.core.spec_cfg  # proposals sized by configured prices, not this machine's timings: not flaky
    llm.core.spec_cfg = dataclasses.replace(cfg, greedy_max_batch=0, auto_off=False, adaptive=False,
                                            tuned=dataclasses.replace(cfg.tuned, measure_cost=False))
    for controls in (dict(repetition_penalty=1.1), dict(presence_penalty=0.2, frequency_penalty=-0.6),
                     dict(logit_bias={41: 2.0}, min_tokens=3, stop_token_ids=[42])):
        base = SamplingParams(max_tokens=40, ignore_eos=True, **controls)
        plain = llm.generate(PROMPTS, dataclasses.replace(base, speculative="none"))
        drafted = accepted = 0
        for prompt, want in zip(PROMPTS, plain):
            rid = llm.add_request(prompt, base)
            req = llm.core.requests[rid]
            got = []
            while llm.has_unfinished():
                got += [t for o in llm.step() if o.request_id == rid for t in o.token_ids]
            drafted, accepted = drafted + req.spec.drafted, accepted + req.spec.accepted
            assert got == want.token_ids, controls
        assert drafted > 0 and accepted > 0, controls


def test_preempted_and_replayed_requests_keep_their_tokens(model_dir):
    prompts = [[(i * 5 + j) % 150 + 3 for j in range(20 + 3 * i)] for i in range(12)]
    params = [SamplingParams(max_tokens=50, ignore_eos=True, seed=i,
                             **{"temperature": 0.9 if i % 2 else 0.0, **CONTROLS[i % len(CONTROLS)]}) for i in range(12)]
    llm = LLM(model_dir, num_pages=20, weights="none", max_running=12)
    outs = llm.generate(prompts, params)
    assert llm.stats()["num_preemptions"] > 0
    alone = LLM(model_dir, num_pages=256, weights="none")
    for prompt, p, out in zip(prompts, params, outs):
        assert out.token_ids == alone.generate([prompt], p)[0].token_ids


def test_each_verification_row_is_processed_with_the_proposals_before_it():
    """Row j of a request's verification samples the token after its first j proposals: its
    penalties count them, its min_tokens window has moved by j. Plain requests' rows are untouched."""
    params = SamplingParams(max_tokens=20, frequency_penalty=1.0, presence_penalty=0.5, min_tokens=4,
                            repetition_penalty=1.3)
    req = Request("r", 0, [1, 2, 3], params, frozenset({9}), context=[1, 2, 3, 5, 6])
    req.generated = 2
    plain = Request("p", 1, [1], SamplingParams(), frozenset(), context=[1, 4])
    props = [Proposal([6, 9, 6]), Proposal([7])]
    logits = [torch.randn(4, 20, generator=torch.Generator().manual_seed(0)), torch.randn(2, 20)]
    out = processed([req, plain], props, logits)
    assert out[1] is logits[1]
    for j in range(4):
        history = [5, 6, *props[0].tokens[:j]]
        want = apply(logits[0][j:j + 1], [RowContext(params, req.prompt, history, req.stops)])[0]
        assert torch.equal(out[0][j], want), j
    assert torch.isinf(out[0][1, 9]) and torch.isfinite(out[0][2, 9])  # 4th generated token: stops allowed
