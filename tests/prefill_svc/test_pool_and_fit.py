"""prefill_svc's GetPrefillPoolStats, and "can never fit" versus "retry later" on both services,
over real loopback gRPC (tests/decode_svc/harness.py)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from kvwire.runtime import EngineConfig
from protos import convert as conv
from protos.kvwire.v1 import kvwire_pb2 as pb
from tests.decode_svc.harness import Harness, tiny_model
from tests.decode_svc.test_engine import ControlledPrefill


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return EngineConfig(model_dir=tiny_model(tmp_path_factory.mktemp("tiny")), num_pages=128)


def paused(holder):
    def wrap(inner):
        holder["w"] = ControlledPrefill(inner, pause=True)
        return holder["w"]
    return wrap


async def prefill_status(h: Harness, tokens: list[int]) -> tuple[grpc.StatusCode, str]:
    try:
        async for _ in h.prefill.Prefill(pb.PrefillRequest(token_ids=tokens), timeout=30):
            pass
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


async def test_pool_stats_follow_a_stream_and_return_to_baseline(cfg):
    holder = {}
    async with Harness(cfg, prefill_wrapper=paused(holder)) as h:
        s = await h.prefill.GetPrefillPoolStats(pb.GetPrefillPoolStatsRequest(), timeout=10)
        spec = h.prefill_runner.runtime.spec
        assert (s.total_pages, s.free_pages, s.used_pages, s.active_streams) == (128, 128, 0, 0)
        assert conv.spec_from_pb(s.spec) == spec and s.usage_fraction == 0.0
        assert s.page_bytes == spec.page_bytes_per_layer * spec.num_layers
        task = asyncio.ensure_future(h.generate(list(range(5, 85)), max_tokens=4))  # 5 pages
        await asyncio.wait_for(holder["w"].chunk_sent.wait(), 10)
        s = await h.prefill.GetPrefillPoolStats(pb.GetPrefillPoolStatsRequest(), timeout=10)
        assert (s.used_pages, s.free_pages, s.active_streams) == (5, 123, 1)
        assert s.usage_fraction == pytest.approx(5 / 128)
        holder["w"].resume.set()
        assert len(await task) == 4
        for _ in range(200):  # the stream's pages go back once its forward is over
            s = await h.prefill.GetPrefillPoolStats(pb.GetPrefillPoolStatsRequest(), timeout=10)
            if (s.free_pages, s.active_streams) == (128, 0):
                break
            await asyncio.sleep(0.05)
        assert (s.free_pages, s.used_pages, s.active_streams) == (128, 0, 0)


async def test_never_fits_and_retry_later_on_prefill_and_decode(cfg):
    holder = {}
    async with Harness(cfg, prefill_wrapper=paused(holder), prefill_pages=8, decode_pages=16) as h:
        # Prefill's pool (8 pages = 128 tokens) can never hold 200 tokens: said so, directly and via decode.
        code, msg = await prefill_status(h, list(range(5, 205)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "can never fit" in msg and "prefill pool has 8" in msg
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await h.generate(list(range(5, 205)), max_tokens=4, kv_source=pb.KV_SOURCE_REMOTE)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "can never fit" in e.value.details()
        # The model's context (512) the same way on both services.
        code, msg = await prefill_status(h, [5] * 600)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "can never fit" in msg and "context of 512" in msg
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await h.generate([5] * 600, max_tokens=4)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "can never fit" in e.value.details()
        # Decode's own pool (16 pages) never fits 200 + 100 tokens (19 pages): said so before any pull.
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await h.generate([5] * 200, max_tokens=100)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "can never fit" in e.value.details()
        assert "decode pool has 16" in e.value.details()
        # Temporary: 7 of prefill's 8 pages held by a paused stream, a 4-page prompt must wait.
        first = asyncio.ensure_future(h.generate(list(range(5, 105)), max_tokens=4))
        await asyncio.wait_for(holder["w"].chunk_sent.wait(), 10)
        code, msg = await prefill_status(h, list(range(5, 65)))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry later" in msg and "never" not in msg
        holder["w"].resume.set()
        assert len(await first) == 4
        assert await h.pools_back_to(16, 8)
