"""A bounded soak of the three services on loopback (not run in CI).

    python -m tools.soak --minutes 3 --clients 8
    python -m tools.soak --minutes 10 --clients 16 --prefill-replicas 2 --decode-replicas 2 --kill-every-s 60

Starts the stack (tools.stack), then for ``--minutes`` (at most 15) runs ``--clients`` concurrent
clients through the front door with a mix of requests: normal greedy and sampled generations,
stop strings, chat, invalid ones (bad sampling, empty prompt), oversized prompts, and clients that
cancel mid-stream. Reports requests, statuses, latency p50/p99 of complete generations, RSS growth
per process and KV pages leaked on every decode and prefill replica (pool back to its total once
idle; must be 0), as JSON. With several replicas of a service (prefill replicas then get every
prompt: decode prefills nothing locally), ``--kill-every-s`` SIGKILLs one replica every so often,
alternating between the services (and their replicas), and restarts it at once; the report lists
the kills and the requests each replica served (its /metrics, since its last start).
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
from tools.stack import Stack, metric_value, metrics_text, proc_memory_mb

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


def kill_order(stack: Stack) -> list[str]:
    """Replicas to kill in turn: alternating services (those with several replicas), cycling replicas."""
    pools = [stack.replicas(s) for s in ("decode_svc", "prefill_svc") if len(stack.replicas(s)) > 1]
    width = max((len(p) for p in pools), default=0)
    return [p[(i + 1) % len(p)] for i in range(width) for p in pools]  # the second replicas first


async def killer(stack: Stack, until: float, every_s: float, t0: float, kills: list[dict]) -> None:
    order, loop = kill_order(stack), asyncio.get_running_loop()
    i = 0
    while order and t0 + (i + 1) * every_s < until:  # a kill at t0 + every_s, t0 + 2 every_s, ...
        await asyncio.sleep(max(0.0, t0 + (i + 1) * every_s - time.monotonic()))
        name = order[i % len(order)]
        i += 1
        stack.kill(name)
        t = time.monotonic()
        await loop.run_in_executor(None, stack.restart, name, 120.0)
        kills.append({"at_s": round(t - t0, 1), "killed": name, "restart_s": round(time.monotonic() - t, 1)})


async def drive(stack: Stack, minutes: float, clients: int, kill_every_s: float = 0.0) -> dict:
    stats = {"codes": Counter(), "by_kind": Counter(), "latency": [], "kills": []}
    t0 = time.monotonic()
    until = t0 + minutes * 60
    tasks = [client(stack.addr("tokenizer_svc"), until, i, stats) for i in range(clients)]
    if kill_every_s > 0:
        tasks.append(killer(stack, until, kill_every_s, t0, stats["kills"]))
    await asyncio.gather(*tasks)
    return stats


async def pool_after_idle(addr: str, service: str = "decode_svc") -> tuple[int, int]:
    """(total, free) pages of a decode or prefill replica once it is idle (or after 10 s)."""
    async with grpc.aio.insecure_channel(addr) as ch:
        for _ in range(100):
            if service == "decode_svc":
                s = await pbg.DecodeServiceStub(ch).GetPoolStats(pb.GetPoolStatsRequest())
                idle = s.running == 0 and s.waiting == 0
            else:
                s = await pbg.PrefillServiceStub(ch).GetPrefillPoolStats(pb.GetPrefillPoolStatsRequest())
                idle = s.active_streams == 0
            if idle and s.free_pages == s.total_pages:
                break
            await asyncio.sleep(0.1)
        return s.total_pages, s.free_pages


def served(stack: Stack, name: str) -> int | None:
    """Requests this replica received since it (re)started, from its /metrics."""
    method = {"decode_svc": "/kvwire.v1.DecodeService/GenerateTokens",
              "prefill_svc": "/kvwire.v1.PrefillService/Prefill",
              "tokenizer_svc": "/kvwire.v1.TokenizerService/GenerateText"}[name.partition(".")[0]]
    try:
        return int(metric_value(metrics_text(stack.metrics_ports[name]), "kvwire:grpc_requests_total",
                                f'grpc_method="{method}"'))
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="how long to drive load (at most 15)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients")
    ap.add_argument("--decode-pages", type=int, default=512)
    ap.add_argument("--prefill-replicas", type=int, default=1)
    ap.add_argument("--decode-replicas", type=int, default=1)
    ap.add_argument("--kill-every-s", type=float, default=0.0,
                    help="SIGKILL one replica this often and restart it (alternating services; only "
                         "services with several replicas; 0 = never)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    args = ap.parse_args(argv)
    if not 0 < args.minutes <= 15:
        ap.error("--minutes must be in (0, 15]")
    replicated = args.prefill_replicas > 1 or args.decode_replicas > 1
    # With several replicas every prompt goes to prefill_svc, so its replicas carry load too.
    extra = {"decode_svc": ["--local-prefill-max-tokens", "0", "--no-local-prefill-when-idle"]} if replicated else {}
    with tempfile.TemporaryDirectory() as logs, Stack(decode_pages=args.decode_pages, prefill_pages=512,
                                                       log_dir=Path(logs), prefill_replicas=args.prefill_replicas,
                                                       decode_replicas=args.decode_replicas, metrics=True,
                                                       extra=extra) as stack:
        names = [n for s in ("tokenizer_svc", "decode_svc", "prefill_svc") for n in stack.replicas(s)]
        rss0 = {n: rss_mb(stack.procs[n].pid) for n in names}
        t0 = time.monotonic()
        stats = asyncio.run(drive(stack, args.minutes, args.clients, args.kill_every_s))
        elapsed = time.monotonic() - t0
        pools = {n: asyncio.run(pool_after_idle(stack.addr(n), n.partition(".")[0])) for n in names
                 if not n.startswith("tokenizer")}
        rss1 = {n: rss_mb(stack.procs[n].pid) for n in names}
        restarts = Counter(k["killed"] for k in stats["kills"])
        lat = sorted(stats["latency"])
        report = {
            "minutes": round(elapsed / 60, 2), "clients": args.clients,
            "requests": sum(stats["codes"].values()),
            "statuses": dict(stats["codes"].most_common()),
            "by_kind": dict(sorted(stats["by_kind"].items())),
            "complete_generations": len(lat),
            "latency_ms": {"p50": round(1e3 * lat[len(lat) // 2], 1),
                           "p99": round(1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 1)} if lat else {},
            # a restarted process's "end" is its new process's (growth is then not a leak measure)
            "rss_mb": {n: {"start": round(rss0[n]), "end": round(rss1[n]), "growth": round(rss1[n] - rss0[n]),
                           "restarts": restarts[n]} for n in names},
            "kills": stats["kills"],
            "served_since_last_start": {n: served(stack, n) for n in names},
            "pages_leaked": {n: total - free for n, (total, free) in pools.items()},
            "decode_pages_leaked": sum(total - free for n, (total, free) in pools.items() if n.startswith("decode")),
            "exit_codes": None,
        }
        report["exit_codes"] = stack.stop()
    text = json.dumps(report, indent=2, ensure_ascii=False)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    bad = {"UNKNOWN", "INTERNAL"} & set(report["statuses"])
    return 1 if bad or any(report["pages_leaked"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
