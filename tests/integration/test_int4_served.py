"""``--weights int4`` / ``int4-awq`` through the services on the embedded model: prefill_svc computes the
prompt's KV on 4-bit blocks rounded at load, decode_svc imports the pages (the fingerprint names
WEIGHTS_MODE_INT4 / WEIGHTS_MODE_INT4_AWQ on both sides) and continues; the tokens equal in-process
greedy generation, for a prompt prefilled remotely and one prefilled by decode_svc itself. int4-awq's
services read the scales this process searched from the shared cache (KVWIRE_AWQ_CACHE)."""
from __future__ import annotations

import asyncio

import pytest

from kvwire import LLM, SamplingParams
from kvwire.config import DEFAULT_MODEL_DIR
from protos.kvwire.v1 import kvwire_pb2 as pb
from tests.integration.served import generate
from tools.stack import Stack

MAX_TOKENS = 12
PROMPTS = ["The list type", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""]


@pytest.mark.parametrize("weights", ["int4", "int4-awq", "int4-gptq"])
def test_int4_served_across_the_wire_equal_in_process(weights, tmp_path, monkeypatch):
    cache = tmp_path / "awq"
    monkeypatch.setenv("KVWIRE_AWQ_CACHE", str(cache))
    llm = LLM(str(DEFAULT_MODEL_DIR), weights=weights, kv_dtype="fp8_e4m3", num_pages=64)
    ids = [llm.encode(p) for p in PROMPTS]
    expected = [out.token_ids for out in llm.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))]
    assert len(list(cache.glob("*.safetensors"))) == {"int4": 0, "int4-awq": 1, "int4-gptq": 2}[weights]
    with Stack(weights=weights, kv_dtype="fp8_e4m3", decode_pages=256, prefill_pages=128, log_dir=tmp_path,
               env={"KVWIRE_AWQ_CACHE": str(cache)}) as s:
        addr = s.addr("decode_svc")
        remote = [asyncio.run(generate(addr, x, pb.KV_SOURCE_REMOTE, MAX_TOKENS)) for x in ids]
        local = [asyncio.run(generate(addr, x, pb.KV_SOURCE_LOCAL, MAX_TOKENS)) for x in ids]
    assert all(expected)
    assert remote == expected
    assert local == expected
