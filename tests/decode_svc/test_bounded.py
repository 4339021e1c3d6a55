"""Bounded waits and prompt release on decode: a stalled prefill ends the request within the KV
transfer timeout (or the caller's deadline, when sooner) with its pages freed on both sides; a
cancelled call's pages go back when the RPC ends, even if grpc leaves the handler suspended."""
from __future__ import annotations

import asyncio
import contextlib
import gc

import grpc
import pytest

from decode_svc.server import DecodeServicer
from kvwire.runtime import EngineConfig
from protos.kvwire.v1 import kvwire_pb2 as pb
from tests.decode_svc.harness import Harness, tiny_model

PROMPT = list(range(5, 85))  # 5 pages per layer
SLACK_S = 0.5  # a deadline read back from grpc may exceed the one set by its clock rounding (~0.1 s)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return EngineConfig(model_dir=tiny_model(tmp_path_factory.mktemp("tiny")), num_pages=128)


class StallingPrefill:
    """Accepts the stream, then stalls: at once (``after`` 0: no header) or after ``after``
    messages of the real stream (its pages then held on both sides). Records the deadline it got."""

    def __init__(self, inner, after: int):
        self.inner, self.after = inner, after
        self.remaining: list[float | None] = []

    async def Prefill(self, request, context):
        self.remaining.append(context.time_remaining())
        sent = 0
        async with contextlib.aclosing(self.inner.Prefill(request, context)) as stream:
            async for msg in stream:
                if sent == self.after:
                    break
                yield msg
                sent += 1
        await asyncio.Event().wait()  # never set: only the caller's deadline or cancel ends this


@pytest.mark.parametrize("after", [0, 2], ids=["silent", "after-header-and-a-chunk"])
async def test_stalled_prefill_ends_within_the_transfer_timeout_and_frees_pages(cfg, after):
    holder = {}

    def wrap(inner):
        holder["p"] = StallingPrefill(inner, after)
        return holder["p"]

    async with Harness(cfg, prefill_wrapper=wrap, transfer_timeout_s=1.0) as h:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(h.generate(PROMPT, max_tokens=8, kv_source=pb.KV_SOURCE_REMOTE), 60)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value.details()
        assert "did not finish within 1.0 s" in e.value.details()  # decode's timeout, not a client's
        assert holder["p"].remaining[0] is not None and holder["p"].remaining[0] <= 1.0 + SLACK_S  # prefill knew
        assert await h.pools_back_to(64, 128)
        # AUTO requests time out the same way (no local retry: the caller's time may be spent).
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await h.generate(PROMPT, max_tokens=8)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert await h.pools_back_to(64, 128)


async def test_the_callers_deadline_caps_the_pull(cfg):
    holder = {}

    def wrap(inner):
        holder["p"] = StallingPrefill(inner, 2)
        return holder["p"]

    async with Harness(cfg, prefill_wrapper=wrap, transfer_timeout_s=30.0) as h:
        call = h.decode.GenerateTokens(pb.GenerateTokensRequest(prompt_token_ids=PROMPT,
                                                                sampling=pb.SamplingParams(max_tokens=8)), timeout=1.5)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in call:
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert holder["p"].remaining[0] <= 1.5 + SLACK_S  # the pull carried the caller's deadline, not 30 s
        assert await h.pools_back_to(64, 128)
        # Without a caller deadline the pull still has one: the transfer timeout.
        task = asyncio.ensure_future(h.generate(PROMPT, max_tokens=8))
        while len(holder["p"].remaining) < 2:
            await asyncio.sleep(0.02)
        task.cancel()
        assert 1.5 + SLACK_S < holder["p"].remaining[1] <= 30.0 + SLACK_S
        assert await h.pools_back_to(64, 128)


class FakeContext:
    """What the servicer uses of a grpc context: here the test ends the RPC and grpc, as it may on a
    cancel, never resumes nor closes the handler's generator."""

    def __init__(self):
        self.callbacks = []

    def add_done_callback(self, cb) -> None:
        self.callbacks.append(cb)

    def time_remaining(self) -> float | None:
        return None

    def end(self) -> None:
        for cb in self.callbacks:
            cb(self)


async def test_rpc_end_frees_the_pages_of_a_handler_grpc_left_suspended(cfg):
    async with Harness(cfg, prefill_addr="") as h:
        ctx = FakeContext()
        handler = DecodeServicer(h.engine).GenerateTokens(
            pb.GenerateTokensRequest(prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=300)), ctx)
        gc.disable()  # nothing may depend on the collector
        try:
            for _ in range(3):
                await handler.__anext__()  # mid-decode; the handler now sits at its yield
            assert h.engine.stats()["used"] > 0
            ctx.end()  # the call was cancelled; `handler` stays referenced and suspended
            assert await h.pools_back_to(64, 128, timeout_s=10)
        finally:
            gc.enable()
        assert handler is not None


@pytest.mark.parametrize("follows", [True, False], ids=["readiness-follows-prefill", "no-readiness-follows-prefill"])
async def test_prefill_watch_sets_readiness_and_the_remote_source(follows):
    from grpc_health.v1 import health_pb2

    from decode_svc.readiness import DECODE_SERVICE, PrefillWatch
    from decode_svc.remote_prefill import RemotePrefill
    from kvwire_serving.server import GrpcServer, build_channel
    from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
    from tools.stack import free_port

    decode = GrpcServer(tracing=False)
    decode.add_service(pbg.add_DecodeServiceServicer_to_server, pbg.DecodeServiceServicer(), DECODE_SERVICE)
    await decode.start("127.0.0.1:0")
    await decode.set_serving()
    port = free_port()
    prefill = GrpcServer(tracing=False)
    prefill.add_service(pbg.add_PrefillServiceServicer_to_server, pbg.PrefillServiceServicer(),
                        "kvwire.v1.PrefillService")
    channel = build_channel(f"127.0.0.1:{port}", tracing=False)
    remote = RemotePrefill(runner=None, stub=None, channel=channel)
    watch = PrefillWatch(channel, remote, decode if follows else None, interval_s=0.2)
    ready = (await decode.health.Check(health_pb2.HealthCheckRequest(service=DECODE_SERVICE), None)).status

    async def decode_status():
        return (await decode.health.Check(health_pb2.HealthCheckRequest(service=DECODE_SERVICE), None)).status

    try:
        await watch.start(await watch.check())  # prefill is down
        assert not remote.healthy and not remote.reachable()  # AUTO requests prefill locally
        assert await decode_status() == (health_pb2.HealthCheckResponse.NOT_SERVING if follows else ready)
        await prefill.start(f"127.0.0.1:{port}")
        await prefill.set_serving()
        for _ in range(300):  # bounded: reconnect backoff is at most 5 s
            if remote.healthy:
                break
            await asyncio.sleep(0.05)
        assert remote.healthy and await decode_status() == health_pb2.HealthCheckResponse.SERVING
        await prefill.set_not_serving()  # draining or loading: not ready either
        for _ in range(100):
            if not remote.healthy:
                break
            await asyncio.sleep(0.05)
        assert not remote.healthy
        assert await decode_status() == (health_pb2.HealthCheckResponse.NOT_SERVING if follows else ready)
    finally:
        await watch.close()
        await channel.close()
        await prefill.stop(0)
        await decode.stop(0)
