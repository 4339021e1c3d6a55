"""A real DecodeService servicer with a scripted reply, served on loopback for the front door's tests."""
import asyncio
import contextlib

import grpc

from kvwire_serving.server import GrpcServer
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pb_grpc


class ScriptedDecode(pb_grpc.DecodeServiceServicer):
    """Streams ``reply`` one token per message (``endless``: forever), then a finish message;
    ``abort`` fails the call with that status after ``abort_after`` tokens. Records requests and
    cancellation."""

    def __init__(self, reply=(), delay=0.0, endless=False, abort: grpc.StatusCode | None = None,
                 abort_after: int = 0):
        self.reply, self.delay, self.endless, self.abort = list(reply), delay, endless, abort
        self.abort_after = abort_after
        self.requests: list[pb.GenerateTokensRequest] = []
        self.cancelled = asyncio.Event()
        self.sent = 0

    async def GenerateTokens(self, request, context):
        self.requests.append(request)
        completed, sent_here = False, 0
        try:
            while True:
                for token in [None, *self.reply]:
                    if self.abort is not None and sent_here >= self.abort_after:
                        completed = True
                        await context.abort(self.abort, "scripted failure")
                    if token is None:
                        continue
                    await asyncio.sleep(self.delay)
                    self.sent += 1
                    sent_here += 1
                    yield pb.GenerateTokensResponse(token_ids=[token])
                if not self.endless:
                    break
            completed = True
            yield pb.GenerateTokensResponse(
                finish_reason=pb.FINISH_REASON_LENGTH,
                usage=pb.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=self.sent))
        finally:
            if not completed:
                self.cancelled.set()


@contextlib.asynccontextmanager
async def served(decode: ScriptedDecode | None, tp=None):
    """Serve ``decode`` on a free loopback port and yield its address; ``None`` yields a port
    nobody listens on (decode down)."""
    if decode is None:
        yield "127.0.0.1:1"
        return
    server = GrpcServer(tracer_provider=tp)
    server.add_service(pb_grpc.add_DecodeServiceServicer_to_server, decode, "kvwire.v1.DecodeService")
    try:
        yield f"127.0.0.1:{await server.start('127.0.0.1:0')}"
    finally:
        await server.stop(0)
