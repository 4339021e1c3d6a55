"""The SmolLM2 draft (models/smollm2-draft, trained by tools/train_draft.py) against its target.

Runs when the target is in the cache (``python -m tools.fetch_model smollm2-135m-instruct``) and is
skipped with the reason otherwise.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvwire import LLM, SamplingParams
from kvwire.fingerprint import tokenizer_sha256
from kvwire.model import gguf, registry
from kvwire.model.source import load_config, model_source
from kvwire.tokenizer import ChatMessage, ModelTokenizer

NAME = "smollm2-135m-instruct"
DRAFT = Path(__file__).resolve().parents[2] / "models" / "smollm2-draft"
MAX_BYTES = 50 * 1000 * 1000
pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not registry.is_cached(NAME),
                                 reason=f"{NAME} is not fetched (python -m tools.fetch_model {NAME})"),
              pytest.mark.skipif(not (DRAFT / "smollm2-draft.gguf").is_file(),
                                 reason="no trained draft in models/smollm2-draft (python -m tools.train_draft)")]


def test_draft_is_small_and_shares_the_targets_shape_vocab_and_tokenizer():
    path = model_source(DRAFT).gguf
    assert path is not None and path.stat().st_size <= MAX_BYTES
    draft, target = load_config(DRAFT), load_config(NAME)
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                  "head_dim", "rms_norm_eps", "rope", "tie_word_embeddings", "bos_token_id", "eos_token_ids"):
        assert getattr(draft, field) == getattr(target, field), field
    assert 1 <= draft.num_layers < target.num_layers
    # decode_svc refuses a draft whose tokenizer fingerprint differs from the target's.
    assert tokenizer_sha256(DRAFT) == tokenizer_sha256(NAME)
    # The tied embedding is the target's own table, byte for byte.
    ours, theirs = (next(t for t in gguf.open_gguf(p).tensors if t.name == "token_embd.weight")
                    for p in (path, registry.cached_path(NAME)))
    assert ours.tensor_type == theirs.tensor_type and np.array_equal(ours.data, theirs.data)
    head = gguf.field(gguf.open_gguf(path), "kvwire.draft.head_vocab")
    assert len(head) > 1000 and max(head) < draft.vocab_size


def test_speculative_greedy_with_the_draft_equals_plain_greedy():
    llm = LLM(NAME, weights="int8", kv_dtype="fp8_e4m3", num_pages=256, draft_model=DRAFT,
              speculative_auto_off=False)  # keep proposing, so the counters below measure the draft
    tok = ModelTokenizer(NAME)
    prompts = ["What is the capital of France?",
               "Explain what this Python code does:\n\n```python\ndef add(a, b):\n    return a + b\n```"]
    drafted = accepted = 0
    for p in prompts:
        ids = tok.encode(tok.apply_chat_template([ChatMessage("user", p)]), add_special_tokens=False)
        [plain] = llm.generate([ids], SamplingParams(max_tokens=24, speculative="none"))
        rid = llm.add_request(ids, SamplingParams(max_tokens=24, speculative="draft", num_speculative_tokens=4))
        req, out, done = llm.core.requests[rid], [], False
        while not done:
            for o in llm.step():
                if o.request_id == rid:
                    out += o.token_ids
                    done = o.finished
        assert out == plain.token_ids, p
        drafted, accepted = drafted + req.spec.drafted, accepted + req.spec.accepted
    # The draft was used and agrees with the target far above chance (measured: 9 of 37 proposals;
    # a draft with random blocks over this 49,152-token vocabulary accepts ~none).
    assert drafted > 0 and accepted / drafted > 0.1
