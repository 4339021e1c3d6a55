"""``--weights gguf`` through the services: prefill_svc computes the prompt's KV on the shipped
SmolLM2 file's Q4_1 blocks, decode_svc imports the pages (the fingerprint names WEIGHTS_MODE_GGUF on
both sides) and continues; the tokens equal in-process greedy generation on the same blocks, for a
prompt prefilled remotely and one prefilled by decode_svc itself."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvwire import LLM, SamplingParams
from kvwire.model import registry
from protos.kvwire.v1 import kvwire_pb2 as pb
from tests.integration.served import generate
from tools.stack import Stack

REAL = "smollm2-135m-instruct"
MAX_TOKENS = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""]

pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not registry.is_cached(REAL),
                                 reason=f"{REAL} is not fetched (python -m tools.fetch_model {REAL})")]


def test_gguf_blocks_served_across_the_wire_equal_in_process(tmp_path):
    llm = LLM(REAL, weights="gguf", kv_dtype="fp8_e4m3", num_pages=64)
    ids = [llm.encode(p) for p in PROMPTS]
    expected = [out.token_ids for out in llm.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))]
    with Stack(model_dir=Path(REAL), weights="gguf", kv_dtype="fp8_e4m3", decode_pages=256, prefill_pages=128,
               log_dir=tmp_path) as s:
        addr = s.addr("decode_svc")
        remote = [asyncio.run(generate(addr, x, pb.KV_SOURCE_REMOTE, MAX_TOKENS)) for x in ids]
        local = [asyncio.run(generate(addr, x, pb.KV_SOURCE_LOCAL, MAX_TOKENS)) for x in ids]
    assert all(len(e) == MAX_TOKENS for e in expected)
    assert remote == expected
    assert local == expected
