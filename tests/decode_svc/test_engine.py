"""decode_svc + prefill_svc over loopback gRPC: correctness, batching, cancellation, error statuses."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import grpc
import pytest

from kvwire.config import KVDtype, QuantMode
from kvwire.generate import generate
from kvwire.runtime import load_engine
from kvwire.sampling_params import SamplingParams
from protos.kvwire.v1 import kvwire_pb2 as pb
from tests.decode_svc.harness import Harness
from tools.stack import free_port


PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 31, 48, 70, 9)]


class ControlledPrefill:
    """Wraps the real PrefillServicer: pause after the first chunk, damage or truncate the stream."""

    def __init__(self, inner, pause=False, corrupt=False, truncate_after=None):
        self.inner, self.pause, self.corrupt, self.truncate_after = inner, pause, corrupt, truncate_after
        self.chunk_sent, self.resume = asyncio.Event(), asyncio.Event()

    async def Prefill(self, request, context):
        chunks = 0
        async with contextlib.aclosing(self.inner.Prefill(request, context)) as stream:
            async for msg in stream:
                if msg.WhichOneof("kind") == "chunk":
                    chunks += 1
                    if self.truncate_after is not None and chunks > self.truncate_after:
                        return
                    if self.corrupt and chunks == 2:
                        data = bytearray(msg.chunk.k_values)
                        data[len(data) // 2] ^= 0x10
                        msg.chunk.k_values = bytes(data)
                yield msg
                if msg.WhichOneof("kind") == "chunk" and self.pause:
                    self.chunk_sent.set()
                    await self.resume.wait()


async def test_matches_in_process_generation_under_concurrency(cfg):
    ref_engine = load_engine(cfg)
    params = [dict(max_tokens=24)] * 3 + [dict(max_tokens=20, temperature=0.8, top_k=50, top_p=0.9, seed=s)
                                          for s in (1, 2, 3)]
    async with Harness(cfg) as h:
        outs = await asyncio.gather(*[h.generate(p, **kw) for p, kw in zip(PROMPTS, params)])
        steps = h.engine.core.total_steps
    for prompt, kw, out in zip(PROMPTS, params, outs):
        expected = generate(ref_engine.model, prompt, SamplingParams(**kw), cache=ref_engine.new_cache(64))
        assert out == expected
    # Continuous batching: concurrent requests shared decode steps.
    assert steps < sum(len(o) - 1 for o in outs)


@pytest.mark.parametrize("kv", [KVDtype.BF16, KVDtype.FP8_E4M3])
async def test_kv_dtypes_and_pool_returns_to_baseline(cfg, kv):
    cfg = dataclasses.replace(cfg, kv_dtype=kv)
    async with Harness(cfg) as h:
        await asyncio.gather(*[h.generate(p, max_tokens=10) for p in PROMPTS])
        assert await h.pools_back_to(64, 128)


async def test_cancel_during_kv_transfer_frees_every_page(cfg):
    holder = {}

    def wrap(inner):
        holder["w"] = ControlledPrefill(inner, pause=True)
        return holder["w"]

    async with Harness(cfg, prefill_wrapper=wrap) as h:
        call = h.decode.GenerateTokens(pb.GenerateTokensRequest(prompt_token_ids=list(range(5, 105)),
                                                          sampling=pb.SamplingParams(max_tokens=50)))
        reader = asyncio.ensure_future(call.read())
        await asyncio.wait_for(holder["w"].chunk_sent.wait(), 10)
        stats = await h.decode.GetPoolStats(pb.GetPoolStatsRequest())
        assert stats.used_pages > 0 and h.prefill_runner.stats()["used"] > 0  # mid-transfer
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert await h.pools_back_to(64, 128)


async def test_cancel_during_decode_frees_every_page(cfg):
    async with Harness(cfg) as h:
        call = h.decode.GenerateTokens(pb.GenerateTokensRequest(prompt_token_ids=list(range(5, 60)),
                                                          sampling=pb.SamplingParams(max_tokens=400)))
        for _ in range(3):
            await call.read()
        assert (await h.decode.GetPoolStats(pb.GetPoolStatsRequest())).used_pages > 0
        call.cancel()
        assert await h.pools_back_to(64, 128)


async def expect_status(coro, code: grpc.StatusCode, match: str):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await coro
    assert e.value.code() == code, e.value.details()
    assert match in e.value.details(), e.value.details()
    return e.value.details()


async def test_model_or_layout_mismatch_is_failed_precondition(cfg):
    async with Harness(cfg, prefill_cfg=dataclasses.replace(cfg, weights=QuantMode.BF16)) as h:
        await expect_status(h.generate([5, 6, 7]), grpc.StatusCode.FAILED_PRECONDITION, "quantization: 'none' != 'bf16'")
    async with Harness(cfg, prefill_cfg=dataclasses.replace(cfg, block_size=32)) as h:
        await expect_status(h.generate([5, 6, 7]), grpc.StatusCode.FAILED_PRECONDITION, "block_size: 16 != 32")
        assert await h.pools_back_to(64, 128)


@pytest.mark.parametrize("damage, match", [(dict(corrupt=True), "checksum"),
                                           (dict(truncate_after=1), "ended early")])
async def test_damaged_kv_is_data_loss(cfg, damage, match):
    async with Harness(cfg, prefill_wrapper=lambda inner: ControlledPrefill(inner, **damage)) as h:
        await expect_status(h.generate(list(range(5, 80))), grpc.StatusCode.DATA_LOSS, match)
        assert await h.pools_back_to(64, 128)


async def test_local_and_remote_prefill_give_the_same_tokens(cfg):
    params = [dict(max_tokens=20), dict(max_tokens=16, temperature=0.8, top_k=40, seed=5)]
    async with Harness(cfg) as h:
        for kw in params:
            for prompt in PROMPTS[:4]:
                local = await h.generate(prompt, kv_source=pb.KV_SOURCE_LOCAL, **kw)
                remote = await h.generate(prompt, kv_source=pb.KV_SOURCE_REMOTE, **kw)
                assert local == remote and len(local) == kw["max_tokens"]
        # Concurrently, mixed in one batch: still the same tokens.
        mixed = await asyncio.gather(*[h.generate(p, kv_source=pb.KV_SOURCE_LOCAL if i % 2 else pb.KV_SOURCE_REMOTE,
                                                  max_tokens=12) for i, p in enumerate(PROMPTS)])
        alone = [await h.generate(p, kv_source=pb.KV_SOURCE_REMOTE, max_tokens=12) for p in PROMPTS]
        assert mixed == alone
        assert await h.pools_back_to(64, 128)


async def test_policy_sends_short_prompts_local_and_long_ones_remote(cfg):
    from kvwire.engine.kv_source import KVSourcePolicy
    async with Harness(cfg, policy=KVSourcePolicy(local_max_tokens=20)) as h:
        used = []
        original = h.engine.sources.fill

        async def spy(req, run, deadline=None, decoding=0):
            first = await original(req, run, deadline, decoding)
            used.append((len(req.prompt), req.kv_source_used))
            return first
        h.engine.sources.fill = spy
        for prompt in PROMPTS[:3]:  # 3, 17, 31 tokens
            await h.generate(prompt, max_tokens=4)
        await h.generate(PROMPTS[2], max_tokens=4, kv_source=pb.KV_SOURCE_LOCAL)  # forced
        await h.generate(PROMPTS[0], max_tokens=4, kv_source=pb.KV_SOURCE_REMOTE)
    assert used == [(3, "local"), (17, "local"), (31, "remote"), (31, "local"), (3, "remote")]


def record_sources(h) -> list:
    """(prompt length, requests decoding, KV source used) of every fill, appended as it ends."""
    used, original = [], h.engine.sources.fill

    async def spy(req, run, deadline=None, decoding=0):
        first = await original(req, run, deadline, decoding)
        used.append((len(req.prompt), decoding, req.kv_source_used))
        return first
    h.engine.sources.fill = spy
    return used


async def until_decoding(h) -> None:
    from kvwire.engine.request import RequestStatus
    for _ in range(500):
        if any(r.status is RequestStatus.RUNNING for r in h.engine.core.scheduler.running.values()):
            return
        await asyncio.sleep(0.01)


async def test_short_prompts_go_remote_while_enough_requests_decode(cfg):
    """A short prompt prefills locally only while fewer than local_max_decoding requests decode here:
    a local prefill holds up every decode step behind it."""
    from kvwire.engine.kv_source import KVSourcePolicy
    async with Harness(cfg, policy=KVSourcePolicy(local_max_tokens=20, local_max_decoding=1)) as h:
        used = record_sources(h)
        long = asyncio.create_task(h.generate(PROMPTS[0], max_tokens=120, ignore_eos=True))
        await until_decoding(h)
        await h.generate(PROMPTS[1], max_tokens=4)  # 17 tokens, one request decoding: remote
        assert len(await long) == 120
        await h.generate(PROMPTS[1], max_tokens=4)  # none decoding: local
        assert await h.pools_back_to(64, 128)
    assert used == [(3, 0, "local"), (17, 1, "remote"), (17, 0, "local")]


async def test_a_long_prompt_prefills_locally_while_the_engine_is_idle(cfg):
    """local_when_idle: with nothing decoding and no prefill in flight, a prompt of any length
    prefills here; while one request decodes, or while another prefill runs, it goes remote."""
    from kvwire.engine.kv_source import KVSourcePolicy
    async with Harness(cfg, policy=KVSourcePolicy(local_when_idle=True, local_max_tokens=0)) as h:
        used = record_sources(h)
        await h.generate(PROMPTS[2], max_tokens=4)  # idle: local
        long = asyncio.create_task(h.generate(PROMPTS[2], max_tokens=120, ignore_eos=True))
        await until_decoding(h)
        await h.generate(PROMPTS[1], max_tokens=4)  # one request decoding: remote
        assert len(await long) == 120
        # two at once: the first prefills here, the second (a prefill in flight) on prefill_svc
        await asyncio.gather(h.generate(PROMPTS[2], max_tokens=4), h.generate(PROMPTS[1], max_tokens=4))
        assert await h.pools_back_to(64, 128)
    assert used[:3] == [(31, 0, "local"), (31, 0, "local"), (17, 1, "remote")]
    # the second sees the first's prefill in flight, or (on a loaded machine) the first already decoding
    assert sorted((n, src) for n, _, src in used[3:]) == [(17, "remote"), (31, "local")]


async def test_prefill_down_serves_locally_unless_remote_is_forced(cfg):
    ref_engine = load_engine(cfg)
    expected = generate(ref_engine.model, PROMPTS[2], SamplingParams(max_tokens=10), cache=ref_engine.new_cache(64))
    async with Harness(cfg, prefill_addr=f"127.0.0.1:{free_port()}") as h:
        await expect_status(h.generate([5, 6, 7], kv_source=pb.KV_SOURCE_REMOTE), grpc.StatusCode.UNAVAILABLE, "")
        assert (await h.decode.GetPoolStats(pb.GetPoolStatsRequest())).free_pages == 64
        assert await h.generate(PROMPTS[2], max_tokens=10) == expected  # AUTO: falls back to local
        assert await h.pools_back_to(64, 128)


async def test_decode_without_any_prefill_replica(cfg):
    async with Harness(cfg, prefill_addr="") as h:
        outs = await asyncio.gather(*[h.generate(p, max_tokens=8) for p in PROMPTS])
        assert [len(o) for o in outs] == [8] * len(PROMPTS)
        await expect_status(h.generate([5, 6, 7], kv_source=pb.KV_SOURCE_REMOTE), grpc.StatusCode.UNAVAILABLE,
                            "no prefill replica")
        assert await h.pools_back_to(64, 128)


@pytest.mark.parametrize("prompt, sampling, match", [
    ([], dict(max_tokens=5), "prompt_token_ids is empty"),
    ([5, 300], dict(max_tokens=5), "outside the vocabulary [0, 300)"),
    ([5] * 500, dict(max_tokens=20), "exceeds the model's context of 512 tokens: it can never fit"),
    ([5], dict(max_tokens=0), "max_tokens must be positive"),
    ([5], dict(max_tokens=5, temperature=-1), "temperature must be >= 0"),
    ([5], dict(max_tokens=5, top_p=1.5), "top_p must be in (0, 1]"),
])
async def test_invalid_arguments(cfg, prompt, sampling, match):
    async with Harness(cfg) as h:
        await expect_status(h.generate(prompt, **sampling), grpc.StatusCode.INVALID_ARGUMENT, match)


async def test_never_fits_is_invalid_argument_and_a_full_queue_resource_exhausted(cfg):
    holder = {}

    def wrap(inner):
        holder["w"] = ControlledPrefill(inner, pause=True)
        return holder["w"]

    async with Harness(cfg, decode_pages=8, max_waiting=1, prefill_wrapper=wrap) as h:
        never = await expect_status(h.generate([5] * 100, max_tokens=100), grpc.StatusCode.INVALID_ARGUMENT,
                                    "needs 13 KV pages")
        assert "can never fit" in never and "retry" not in never
        first = asyncio.ensure_future(h.generate([5] * 60, max_tokens=40))  # 4 pages now (7 at most): admitted, paused
        await asyncio.wait_for(holder["w"].chunk_sent.wait(), 10)
        second = asyncio.ensure_future(h.generate([5] * 70, max_tokens=40))  # 5 pages now: waits in the queue
        await asyncio.sleep(0.2)
        full = await expect_status(h.generate([5] * 10, max_tokens=5), grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   "queue is full")
        assert "retry later" in full and "never" not in full
        holder["w"].resume.set()
        a, b = await asyncio.gather(first, second)
        assert len(a) == 40 and len(b) == 40
        assert await h.pools_back_to(8, 128)
