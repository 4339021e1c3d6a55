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
                 abort_after: int = 0, finish: int = pb.FINISH_REASON_LENGTH):
        self.reply, self.delay, self.endless, self.abort = list(reply), delay, endless, abort
        self.finish = finish  # the finish reason of the last message
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
                    prompt = scripted_prompt_logprobs(request) if sent_here == 1 else []
                    yield pb.GenerateTokensResponse(token_ids=[token], logprobs=scripted_logprobs(request, token),
                                                    prompt_logprobs=prompt)
                if not self.endless:
                    break
            completed = True
            yield pb.GenerateTokensResponse(
                finish_reason=self.finish,
                usage=pb.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=self.sent))
        finally:
            if not completed:
                self.cancelled.set()


def scripted_logprobs(request: pb.GenerateTokensRequest, token: int) -> list[pb.TokenLogprob]:
    """When asked: token t has logprob -t/100; the top k are t, t+1, ... at -t/100, -(t+1)/100, ..."""
    if not request.sampling.HasField("logprobs"):
        return []
    top = [pb.TopLogprob(token_id=token + i, logprob=-(token + i) / 100) for i in range(request.sampling.logprobs)]
    return [pb.TokenLogprob(token_id=token, logprob=-token / 100, top_logprobs=top)]


def scripted_prompt_logprobs(request: pb.GenerateTokensRequest) -> list[pb.TokenLogprob]:
    """When asked: prompt token t (after the first) has logprob -t/1000, and no top entries."""
    if not request.sampling.HasField("prompt_logprobs"):
        return []
    return [pb.TokenLogprob(token_id=t, logprob=-t / 1000) for t in request.prompt_token_ids[1:]]


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
