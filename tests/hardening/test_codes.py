"""Statuses a caller sees for a peer's failures (kvwire_serving.server.status_for), over real loopback gRPC."""
from __future__ import annotations

import asyncio

import grpc

from kvwire_serving.server import DEFAULT_MAX_MESSAGE_BYTES, GrpcServer, build_channel, status_for
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from tools.stack import free_port


class HugeChunkPrefill(pbg.PrefillServiceServicer):
    async def Prefill(self, request, context):
        yield pb.PrefillResponse(chunk=pb.KVChunk(k_values=b"\0" * (DEFAULT_MAX_MESSAGE_BYTES + 1024)))


def test_oversized_chunk_from_a_peer_is_data_loss_not_resource_exhausted():
    async def main():
        server = GrpcServer(tracing=False, max_message_bytes=4 * DEFAULT_MAX_MESSAGE_BYTES)
        server.add_service(pbg.add_PrefillServiceServicer_to_server, HugeChunkPrefill(), "kvwire.v1.PrefillService")
        port = await server.start("127.0.0.1:0")
        try:
            async with build_channel(f"127.0.0.1:{port}", tracing=False) as ch:
                try:
                    async for _ in pbg.PrefillServiceStub(ch).Prefill(pb.PrefillRequest(token_ids=[1]), timeout=10):
                        pass
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # what gRPC itself says
                    return status_for(e)
        finally:
            await server.stop(0)
    code, message = asyncio.run(main())
    assert code == grpc.StatusCode.DATA_LOSS and "larger than the limit" in message


def test_unreachable_peer_is_unavailable_without_its_address():
    async def main():
        port = free_port()  # nothing listens there
        async with build_channel(f"127.0.0.1:{port}", tracing=False) as ch:
            try:
                await pbg.DecodeServiceStub(ch).GetPoolStats(pb.GetPoolStatsRequest(), timeout=5)
            except grpc.aio.AioRpcError as e:
                assert str(port) in e.details()  # gRPC's own wording names the address...
                return status_for(e), port
    (code, message), port = asyncio.run(main())
    assert code == grpc.StatusCode.UNAVAILABLE  # ...the caller's does not
    assert str(port) not in message and "127.0.0.1" not in message and "retry" in message
