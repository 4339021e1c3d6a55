"""``python -m tokenizer_svc.client "The for statement"``: stream a completion to the terminal.

A plain gRPC client of the front door (kvwire.v1.TokenizerService/GenerateText): text deltas are
printed as they arrive; the finish reason, token counts, time to first token and decode speed
go to stderr at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

import grpc

from kvwire_serving.server import build_channel
from protos import convert as conv
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pb_grpc


async def stream(addr: str, request: pb.GenerateTextRequest, out=sys.stdout) -> pb.GenerateTextResponse:
    async with build_channel(addr, tracing=False) as channel:
        stub = pb_grpc.TokenizerServiceStub(channel)
        start, first_at, last, n = time.perf_counter(), None, None, 0
        async for msg in stub.GenerateText(request):
            if msg.text:
                first_at = first_at or time.perf_counter()
                out.write(msg.text)
                out.flush()
            n += len(msg.token_ids)
            last = msg
        end = time.perf_counter()
    reason = conv.finish_from_pb(last.finish_reason).value
    ttft = (first_at or end) - start
    speed = (n - 1) / (end - first_at) if first_at and n > 1 and end > first_at else 0.0
    print(f"\n[finish: {reason}; {last.usage.prompt_tokens} prompt + {last.usage.completion_tokens} "
          f"completion tokens; TTFT {ttft * 1000:.0f} ms; {speed:.1f} tokens/s after the first]", file=sys.stderr)
    return last


def build_request(args: argparse.Namespace) -> pb.GenerateTextRequest:
    sampling = pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p)
    if args.seed is not None:
        sampling.seed = args.seed
    req = pb.GenerateTextRequest(sampling=sampling, stops=args.stop or [])
    if args.chat:
        req.chat.messages.add(role="user", content=args.prompt)
    else:
        req.text = args.prompt
    return req


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tokenizer_svc.client", description=__doc__.split("\n\n")[0])
    ap.add_argument("prompt")
    ap.add_argument("--addr", default="127.0.0.1:50051", help="tokenizer_svc address")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", help="stop string (repeatable)")
    ap.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    args = ap.parse_args(argv)
    try:
        asyncio.run(stream(args.addr, build_request(args)))
    except grpc.aio.AioRpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
