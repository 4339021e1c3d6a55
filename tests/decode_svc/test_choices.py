"""n > 1 choices through real gRPC servers: decode forks after its local prefill or after importing
the prompt's pages from prefill_svc (which samples every choice's first token); each choice's
messages carry its index and end with its own finish reason; nothing is left in either pool."""
from __future__ import annotations

import asyncio

import grpc

from protos.kvwire.v1 import kvwire_pb2 as pb
from tests.decode_svc.harness import Harness
from tests.decode_svc.test_engine import expect_status

PROMPT = [(j * 11) % 250 + 3 for j in range(40)]  # 2 full pages of 16 and a partial one


async def choices(h: Harness, kv_source: int, **sampling) -> tuple[dict, dict, dict, dict]:
    """Per choice index: tokens, logprob token ids, finish reason, usage of its last message."""
    tokens, lps, reasons, usage = {}, {}, {}, {}
    async for m in h.decode.GenerateTokens(pb.GenerateTokensRequest(
            prompt_token_ids=PROMPT, sampling=pb.SamplingParams(**sampling), kv_source=kv_source)):
        assert m.index not in reasons  # nothing after a choice's last message
        tokens.setdefault(m.index, []).extend(m.token_ids)
        lps.setdefault(m.index, []).extend(lp.token_id for lp in m.logprobs)
        if m.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            reasons[m.index], usage[m.index] = m.finish_reason, (m.usage.prompt_tokens, m.usage.completion_tokens)
    return tokens, lps, reasons, usage


async def test_choices_local_and_remote_are_the_same_and_seeded_per_choice(cfg):
    async with Harness(cfg) as h:
        sampling = dict(max_tokens=8, temperature=1.0, seed=21, n=3, ignore_eos=True, logprobs=1)
        local = await choices(h, pb.KV_SOURCE_LOCAL, **sampling)
        remote = await choices(h, pb.KV_SOURCE_REMOTE, **sampling)
        tokens, lps, reasons, usage = remote
        assert sorted(tokens) == [0, 1, 2] and local == remote
        assert all(lps[i] == tokens[i] for i in tokens)  # logprobs per choice, beside its tokens
        assert reasons == {i: pb.FINISH_REASON_LENGTH for i in range(3)}
        assert usage == {i: (len(PROMPT), 8) for i in range(3)}
        assert len({tuple(t) for t in tokens.values()}) == 3
        for i in range(3):  # choice i is n = 1 with seed + i
            alone = await h.generate(PROMPT, pb.KV_SOURCE_REMOTE, max_tokens=8, temperature=1.0, seed=21 + i,
                                     ignore_eos=True)
            assert alone == tokens[i]
        greedy, *_ = await choices(h, pb.KV_SOURCE_REMOTE, max_tokens=8, n=2, ignore_eos=True)
        assert greedy[0] == greedy[1] == await h.generate(PROMPT, max_tokens=8, ignore_eos=True)
        assert await h.pools_back_to(64, 128)


async def test_pool_shows_the_shared_prompt_pages_while_choices_decode(cfg):
    async with Harness(cfg, decode_pages=64) as h:
        stream = h.decode.GenerateTokens(pb.GenerateTokensRequest(
            prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=60, ignore_eos=True, n=4),
            kv_source=pb.KV_SOURCE_REMOTE))
        seen = set()
        async for m in stream:
            seen.add(m.index)
            if len(seen) == 4:
                break
        stats = await h.decode.GetPoolStats(pb.GetPoolStatsRequest())
        assert stats.shared_pages == 2  # the prompt's full pages, held by all 4 choices
        assert stats.used_pages <= 2 + 4 * 2 < 4 * 3  # one prompt and 4 answers so far, not 4 prompts
        stream.cancel()  # cancelled mid-stream: every choice's pages go back
        assert await h.pools_back_to(64, 128)


async def test_n_out_of_range_is_invalid_argument(cfg):
    async with Harness(cfg) as h:
        await expect_status(h.generate(PROMPT, n=17), grpc.StatusCode.INVALID_ARGUMENT, "n must be in [1, 16]")
        await expect_status(h.generate(PROMPT, n=0), grpc.StatusCode.INVALID_ARGUMENT, "n must be in [1, 16]")
        await asyncio.sleep(0)
        assert await h.pools_back_to(64, 128)


async def test_preempted_choices_of_a_remote_prefill_recompute_to_the_same_tokens(cfg):
    """16 pages: an n = 3 request forked after its import (11 pages at its end, shared ones counted
    once) and a local one (11 pages at its end) outgrow the pool while decoding; preempted requests
    are recomputed here, and every output ends as with room. The local request lasts 150 steps, so
    the two overlap however fast the import comes."""
    async def both(h: Harness):
        return await asyncio.gather(
            choices(h, pb.KV_SOURCE_REMOTE, max_tokens=40, temperature=0.9, seed=8, n=3, ignore_eos=True),
            h.generate(PROMPT[:20], pb.KV_SOURCE_LOCAL, max_tokens=150, ignore_eos=True))
    async with Harness(cfg) as roomy:
        want = await both(roomy)
    async with Harness(cfg, decode_pages=16) as h:
        got = await both(h)
        stats = await h.decode.GetPoolStats(pb.GetPoolStatsRequest())
        assert stats.num_preemptions > 0
        assert got == want
        assert await h.pools_back_to(16, 128)
