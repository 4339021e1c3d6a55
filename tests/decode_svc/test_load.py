"""Under load, decode_svc makes requests wait instead of refusing them: a burst far past the decode
pool completes by preemption with every output as when run alone, and a full prefill pool sends
AUTO requests to the local prefill (real gRPC servers on loopback, the tiny model)."""
from __future__ import annotations

import asyncio
import dataclasses

from kvwire import LLM, SamplingParams
from kvwire.metrics import PoolCollector
from tests.decode_svc.harness import Harness


def alone(cfg, prompt, **sampling) -> list[int]:
    llm = LLM(cfg.model_dir, weights=cfg.weights.value, kv_dtype=cfg.kv_dtype.value, num_pages=256)
    return llm.generate([prompt], SamplingParams(**sampling))[0].token_ids


async def test_a_burst_of_four_pools_completes_by_preemption_with_the_outputs_alone(cfg):
    """24 pages hold about 4 of these requests at their longest: 16 at once, greedy and seeded,
    their KV from prefill_svc or computed here, all finish with no error and their own tokens."""
    prompts = [[(i * 5 + j) % 250 + 3 for j in range(20 + 3 * i)] for i in range(16)]
    sampling = [dict(max_tokens=60, ignore_eos=True) if i % 2 else
                dict(max_tokens=60, ignore_eos=True, temperature=0.8, seed=i) for i in range(16)]
    async with Harness(cfg, decode_pages=24, max_waiting=64) as h:
        outs = await asyncio.gather(*(h.generate(p, **s) for p, s in zip(prompts, sampling)))
        stats = h.engine.stats()
        assert stats["num_preemptions"] > 0
        assert await h.pools_back_to(24, 128)
    for prompt, s, out in zip(prompts, sampling, outs):
        assert out == alone(cfg, prompt, **s)
    families = {f.name: f for f in PoolCollector(lambda: stats)._families(stats)}
    assert families["kvwire:num_preemptions"].samples[0].value == stats["num_preemptions"]


async def test_a_full_prefill_pool_sends_auto_requests_to_the_local_prefill(cfg):
    """prefill_svc's 6 pages hold one 70-token prompt at a time: the others' pulls are refused
    (RESOURCE_EXHAUSTED) and decode computes them itself; nobody sees an error."""
    prompts = [[(i * 11 + j) % 250 + 3 for j in range(70)] for i in range(6)]
    async with Harness(dataclasses.replace(cfg), decode_pages=128, prefill_pages=6) as h:
        outs = await asyncio.gather(*(h.generate(p, max_tokens=8, ignore_eos=True) for p in prompts))
        assert await h.pools_back_to(128, 6)
    for prompt, out in zip(prompts, outs):
        assert out == alone(cfg, prompt, max_tokens=8, ignore_eos=True)
