"""A bounded soak of the three services on loopback (not run in CI).

    python -m tools.soak --minutes 3 --clients 8

Starts the stack (tools.stack), then for ``--minutes`` (at most 15) runs ``--clients`` concurrent
clients through the front door with a mix of requests: normal greedy and sampled generations,
stop strings, chat, invalid ones (bad sampling, empty prompt), oversized prompts, and clients that
cancel mid-stream. Reports requests, statuses, latency p50/p99 of complete generations, RSS growth
per service and KV pages leaked on decode (pool back to its total once idle; must be 0), as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc

from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from tools.stack import Stack, proc_memory_mb

PROMPTS = ["The for statement", "A class definition", "Exceptions can be raised", "The import statement",
           "Lambda expressions are", "The with statement", "안녕하세요 👋", "Integer literals"]


def rss_mb(pid: int) -> float:
    return proc_memory_mb(pid).get("VmRSS", float("nan"))


def make_request(rng: random.Random) -> tuple[str, pb.GenerateTextRequest]:
    kind = rng.choices(["greedy", "sampled", "stop", "chat", "invalid", "empty", "huge", "cancel"],
                       weights=[30, 20, 10, 10, 10, 5, 5, 10])[0]
    sampling = pb.SamplingParams(max_tokens=rng.randint(1, 32))
    req = pb.GenerateTextRequest(text=rng.choice(PROMPTS), sampling=sampling)
    if kind == "sampled":
        req.sampling.temperature, req.sampling.top_p, req.sampling.seed = 0.8, 0.9, rng.randint(0, 1000)
    elif kind == "stop":
        req.stops.append(" ")
    elif kind == "chat":
        req.chat.messages.add(role="user", content=rng.choice(PROMPTS))
    elif kind == "invalid":
        req.sampling.top_p = rng.choice([0.0, 1.5, -1.0])
    elif kind == "empty":
        req.text = ""
    elif kind == "huge":
        req.text = "word " * 300_000  # 1.5 MB: over --max-prompt-bytes
    return kind, req


async def client(addr: str, until: float, seed: int, stats: dict) -> None:
    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(addr, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        stub = pbg.TokenizerServiceStub(ch)
        while time.monotonic() < until:
            kind, req = make_request(rng)
            t = time.perf_counter()
            call = stub.GenerateText(req, timeout=60)
            code = "OK"
            try:
                n = 0
                async for _ in call:
                    n += 1
                    if kind == "cancel" and n == 2:
                        call.cancel()
                        code = "CANCELLED (by client)"
                        break
                if code == "OK":
                    stats["latency"].append(time.perf_counter() - t)
            except asyncio.CancelledError:
                code = "CANCELLED (by client)"
            except grpc.aio.AioRpcError as e:
                code = e.code().name
            stats["codes"][code] += 1
            stats["by_kind"][f"{kind}:{code}"] += 1


async def drive(stack: Stack, minutes: float, clients: int) -> dict:
    stats = {"codes": Counter(), "by_kind": Counter(), "latency": []}
    until = time.monotonic() + minutes * 60
    await asyncio.gather(*[client(stack.addr("tokenizer_svc"), until, i, stats) for i in range(clients)])
    return stats


async def pool_after_idle(addr: str) -> pb.GetPoolStatsResponse:
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = pbg.DecodeServiceStub(ch)
        for _ in range(100):
            s = await stub.GetPoolStats(pb.GetPoolStatsRequest())
            if s.running == 0 and s.waiting == 0 and s.free_pages == s.total_pages:
                break
            await asyncio.sleep(0.1)
        return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="how long to drive load (at most 15)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients")
    ap.add_argument("--decode-pages", type=int, default=512)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    args = ap.parse_args(argv)
    if not 0 < args.minutes <= 15:
        ap.error("--minutes must be in (0, 15]")
    with tempfile.TemporaryDirectory() as logs, Stack(decode_pages=args.decode_pages, prefill_pages=512,
                                                       log_dir=Path(logs)) as stack:
        names = ("tokenizer_svc", "decode_svc", "prefill_svc")
        rss0 = {n: rss_mb(stack.procs[n].pid) for n in names}
        t0 = time.monotonic()
        stats = asyncio.run(drive(stack, args.minutes, args.clients))
        elapsed = time.monotonic() - t0
        pool = asyncio.run(pool_after_idle(stack.addr("decode_svc")))
        rss1 = {n: rss_mb(stack.procs[n].pid) for n in names}
        lat = sorted(stats["latency"])
        report = {
            "minutes": round(elapsed / 60, 2), "clients": args.clients,
            "requests": sum(stats["codes"].values()),
            "statuses": dict(stats["codes"].most_common()),
            "by_kind": dict(sorted(stats["by_kind"].items())),
            "complete_generations": len(lat),
            "latency_ms": {"p50": round(1e3 * lat[len(lat) // 2], 1),
                           "p99": round(1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 1)} if lat else {},
            "rss_mb": {n: {"start": round(rss0[n]), "end": round(rss1[n]), "growth": round(rss1[n] - rss0[n])}
                       for n in names},
            "decode_pages_leaked": pool.total_pages - pool.free_pages,
            "exit_codes": None,
        }
        report["exit_codes"] = stack.stop()
    text = json.dumps(report, indent=2, ensure_ascii=False)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    bad = {"UNKNOWN", "INTERNAL"} & set(report["statuses"])
    return 1 if bad or report["decode_pages_leaked"] else 0


if __name__ == "__main__":
    sys.exit(main())
