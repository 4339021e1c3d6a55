"""Chunked prefill mixed with decoding, and preemption by recompute, through the in-process engine.

The scheduler's arithmetic is tested in test_scheduler.py; here the real model runs: chunked
prompts give the unchunked tokens (bf16 KV, fp32 weights: exact), a prompt's tokens do not depend
on what runs beside it, and a burst far past the pool's capacity finishes with every output as
when run alone, preempting on the way.
"""
from __future__ import annotations

import pytest

from kvwire import LLM, SamplingParams
from tests.decode_svc.harness import tiny_model

PROMPTS = [[(i * 7 + j * 3) % 200 + 3 for j in range(n)] for i, n in enumerate((5, 40, 77, 130, 190, 16, 33))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny"))


def run(model_dir, prompts, params, **kw):
    llm = LLM(model_dir, **{"num_pages": 256, **kw})
    outs = llm.generate(prompts, params)
    assert llm.stats()["used"] == 0 and llm.stats()["reserved_pages"] == 0
    return [o.token_ids for o in outs], llm


@pytest.mark.parametrize("chunk", [16, 24, 64])
def test_chunked_prefill_gives_the_unchunked_tokens_with_bf16_kv(model_dir, chunk):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    whole, _ = run(model_dir, PROMPTS, params, weights="none", kv_dtype="bf16", chunked_prefill=False)
    chunked, llm = run(model_dir, PROMPTS, params, weights="none", kv_dtype="bf16", prefill_chunk_size=chunk,
                       max_num_batched_tokens=chunk + 8)
    assert chunked == whole
    assert llm.core.total_steps > len(PROMPTS)  # prompts did go in chunks, beside decode steps


@pytest.mark.parametrize("weights", ["int8", "none"])
def test_a_prompts_tokens_do_not_depend_on_what_runs_beside_it(model_dir, weights):
    """FP8 KV: chunk boundaries are fixed by the prompt, and prompts computed together (packed int8:
    one forward) or apart (fp32: one forward each) keep their own bits."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    kw = dict(weights=weights, kv_dtype="fp8_e4m3", prefill_chunk_size=32, max_num_batched_tokens=96)
    together, _ = run(model_dir, PROMPTS, params, **kw)
    alone = [run(model_dir, [p], params, **kw)[0][0] for p in PROMPTS]
    assert together == alone


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_a_burst_past_the_pool_completes_by_preempting_with_the_same_outputs(model_dir, kv):
    """24 pages of 16 tokens hold about 4 of these requests at their longest; 16 at once (greedy and
    seeded sampled) all finish, preempted and recomputed on the way, each with its tokens alone."""
    prompts = [[(i * 5 + j) % 150 + 3 for j in range(20 + 3 * i)] for i in range(16)]
    params = [SamplingParams(max_tokens=60, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.8, seed=i) for i in range(16)]
    llm = LLM(model_dir, num_pages=24, kv_dtype=kv, weights="none", max_running=16)
    outs = llm.generate(prompts, params)
    assert llm.stats()["num_preemptions"] > 0 and llm.stats()["used"] == 0
    alone = LLM(model_dir, num_pages=256, kv_dtype=kv, weights="none")
    for prompt, p, out in zip(prompts, params, outs):
        assert len(out.token_ids) == 60
        assert out.token_ids == alone.generate([prompt], p)[0].token_ids
