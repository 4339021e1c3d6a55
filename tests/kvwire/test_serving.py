"""kvwire_serving.server against the stock grpc health and reflection clients, on a real loopback server."""
import asyncio
import os
import signal

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from kvwire import errors
from kvwire_serving.server import GrpcServer, build_channel
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pb_grpc

SERVICE = "kvwire.v1.TokenizerService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

RAISES = {
    "invalid": errors.InvalidRequest("max_tokens must be positive"),
    "request": errors.InvalidRequest("top_p must be in (0, 1]"),
    "value": ValueError("an internal invariant broke"),
    "notfound": errors.NotFound("no such request"),
    "exhausted": errors.ResourceExhausted("pool full"),
    "precondition": errors.FailedPrecondition("fingerprint mismatch: weights_sha256 a != b"),
    "dataloss": errors.DataLoss("crc32 mismatch in layer 3"),
    "unavailable": errors.Unavailable("no prefill replica"),
    "boom": RuntimeError("secret internals"),
}


class Servicer(pb_grpc.TokenizerServiceServicer):
    """Raises whatever the request's text names; 'peer' calls a port where nothing listens."""

    async def _act(self, text: str) -> None:
        if text == "peer":
            async with build_channel("127.0.0.1:1") as ch:
                await pb_grpc.DecodeServiceStub(ch).GetPoolStats(pb.GetPoolStatsRequest(), timeout=5)
        if text in RAISES:
            raise RAISES[text]
        if text == "slow":
            await asyncio.sleep(0.3)

    async def Tokenize(self, request, context):
        await self._act(request.text)
        return pb.TokenizeResponse(token_ids=[1, 2, 3])

    async def GenerateText(self, request, context):
        yield pb.GenerateTextResponse(text="first")
        await self._act(request.text)
        yield pb.GenerateTextResponse(text="last", finish_reason=pb.FINISH_REASON_STOP)


async def started() -> tuple[GrpcServer, str]:
    server = GrpcServer()
    server.add_service(pb_grpc.add_TokenizerServiceServicer_to_server, Servicer(), SERVICE)
    port = await server.start("127.0.0.1:0")
    return server, f"127.0.0.1:{port}"


async def health_of(target: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(target) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service))
        return resp.status


def test_health_not_serving_until_ready_then_serving_then_draining():
    async def main():
        server, target = await started()
        assert await health_of(target) == NOT_SERVING
        assert await health_of(target, SERVICE) == NOT_SERVING
        await server.set_serving()
        assert await health_of(target) == SERVING
        assert await health_of(target, SERVICE) == SERVING
        # An in-flight call survives the drain; health says NOT_SERVING while draining.
        async with build_channel(target) as ch:
            inflight = asyncio.ensure_future(pb_grpc.TokenizerServiceStub(ch).Tokenize(
                pb.TokenizeRequest(text="slow")))
            await asyncio.sleep(0.05)
            stopping = asyncio.ensure_future(server.stop(grace_s=5, drain_delay_s=0.2))
            await asyncio.sleep(0.05)
            assert await health_of(target) == NOT_SERVING
            assert list((await inflight).token_ids) == [1, 2, 3]
            await stopping
    asyncio.run(main())


def test_reflection_lists_services_to_the_stock_client():
    async def main():
        server, target = await started()
        try:
            def reflect():
                with grpc.insecure_channel(target) as ch:
                    db = ProtoReflectionDescriptorDatabase(ch)
                    services = set(db.get_services())
                    methods = {m.name for m in DescriptorPool(db).FindServiceByName(SERVICE).methods}
                    return services, methods
            services, methods = await asyncio.to_thread(reflect)  # sync client: off the loop
        finally:
            await server.stop(0)
        assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
        assert methods == {"GenerateText", "Tokenize", "Detokenize"}
    asyncio.run(main())


EXPECTED = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT, "request": grpc.StatusCode.INVALID_ARGUMENT,
    "value": grpc.StatusCode.INTERNAL,  # a ValueError from our own code is a bug, not bad input
    "notfound": grpc.StatusCode.NOT_FOUND, "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "precondition": grpc.StatusCode.FAILED_PRECONDITION, "dataloss": grpc.StatusCode.DATA_LOSS,
    "unavailable": grpc.StatusCode.UNAVAILABLE, "boom": grpc.StatusCode.INTERNAL,
    "peer": grpc.StatusCode.UNAVAILABLE,
}


def test_errors_map_to_status_codes_for_unary_and_streaming():
    async def main():
        server, target = await started()
        got = {}
        try:
            async with build_channel(target) as ch:
                stub = pb_grpc.TokenizerServiceStub(ch)
                for text in EXPECTED:
                    with pytest.raises(grpc.aio.AioRpcError) as unary:
                        await stub.Tokenize(pb.TokenizeRequest(text=text))
                    received = []
                    with pytest.raises(grpc.aio.AioRpcError) as streaming:
                        async for msg in stub.GenerateText(pb.GenerateTextRequest(text=text)):
                            received.append(msg.text)
                    assert received == ["first"]  # messages before the error still arrive
                    got[text] = (unary.value.code(), unary.value.details(),
                                 streaming.value.code(), streaming.value.details())
                ok = await stub.Tokenize(pb.TokenizeRequest(text="fine"))
                assert list(ok.token_ids) == [1, 2, 3]
        finally:
            await server.stop(0)
        for text, code in EXPECTED.items():
            assert got[text][0] == code and got[text][2] == code, (text, got[text])
        assert got["dataloss"][1] == "crc32 mismatch in layer 3"
        assert got["request"][3] == "top_p must be in (0, 1]"
        assert "invariant" not in got["value"][1] and "ValueError" in got["value"][1]
        assert "secret" not in got["boom"][1] and "RuntimeError" in got["boom"][1]
    asyncio.run(main())


def test_channel_and_server_carry_messages_over_the_4mib_default():
    async def main():
        server, target = await started()
        try:
            async with build_channel(target) as ch:
                big = "x" * (5 << 20)  # over the 4 MiB default receive limit
                ok = await pb_grpc.TokenizerServiceStub(ch).Tokenize(pb.TokenizeRequest(text=big))
                assert list(ok.token_ids) == [1, 2, 3]
        finally:
            await server.stop(0)
    asyncio.run(main())


def test_serve_until_signal_drains_and_stops():
    async def main():
        server, target = await started()
        await server.set_serving()
        task = asyncio.ensure_future(server.serve_until_signal(grace_s=1, signals=(signal.SIGUSR1,)))
        await asyncio.sleep(0.1)  # handlers installed
        os.kill(os.getpid(), signal.SIGUSR1)
        await asyncio.wait_for(task, 5)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await health_of(target)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    asyncio.run(main())


def test_calls_are_traced_across_the_hop_but_health_checks_are_not():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))

    async def main():
        server = GrpcServer(tracer_provider=tp)
        server.add_service(pb_grpc.add_TokenizerServiceServicer_to_server, Servicer(), SERVICE)
        target = f"127.0.0.1:{await server.start('127.0.0.1:0')}"
        try:
            async with build_channel(target, tracer_provider=tp) as ch:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                await pb_grpc.TokenizerServiceStub(ch).Tokenize(pb.TokenizeRequest(text="ok"))
                with pytest.raises(grpc.aio.AioRpcError):
                    await pb_grpc.TokenizerServiceStub(ch).Tokenize(pb.TokenizeRequest(text="invalid"))
        finally:
            await server.stop(0)
    asyncio.run(main())
    spans = exporter.get_finished_spans()
    assert not [s for s in spans if "Health" in s.name]
    ok_server, bad_server = [s for s in spans if s.kind.name == "SERVER"]
    ok_client = next(s for s in spans if s.kind.name == "CLIENT")
    assert ok_server.name == "/kvwire.v1.TokenizerService/Tokenize"
    assert ok_server.context.trace_id == ok_client.context.trace_id
    assert ok_server.parent.span_id == ok_client.context.span_id
    assert bad_server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
