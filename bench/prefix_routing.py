"""Prefix caching with two decode replicas: gRPC round_robin against --decode-routing prefix.

    python -m bench prefix-routing [--model-dir PATH] [--groups 16] [--turns 4] [--decode-pages 256]

The three services run as processes on loopback (tools.stack: 1 prefill, ``--decode-replicas``
decode with --prefix-caching, every prompt's KV pulled from prefill_svc). ``--groups``
conversations, each its own system prompt (``--system-chars`` of held-out text) plus a new user
turn per request, are sent turn by turn (every conversation's first turn, then every second one,
..., shuffled within a turn) by ``--clients`` concurrent clients, once per routing policy. Reports
TTFT as the client sees it and the prefix-cache hit rate: the share of prompt pages decode did not
pull from prefill (1 - KV bytes received / (prompt pages x page bytes), from each decode's /metrics).
Figures and what they mean: docs/decisions/055-prefix-routing.md.
Writes bench/out/prefix-routing-<model>-<stamp>.{json,md}.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path

import grpc

from bench import common
from kvwire.config import DEFAULT_MODEL_DIR
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from tools.stack import Stack, metric_value, metrics_text

ALL_REMOTE = ["--local-prefill-max-tokens", "0", "--no-local-prefill-when-idle", "--prefix-caching"]


def conversations(groups: int, turns: int, system_chars: int, turn_chars: int) -> list[list[str]]:
    from tools.train_embedded import load_corpus
    _, held, _ = load_corpus()
    text = " ".join(" ".join(t.split()) for t in held)
    need = groups * (system_chars + turns * turn_chars)
    if len(text) < need:
        raise SystemExit(f"the held-out corpus has {len(text)} characters, {need} needed; lower --groups or --turns")
    out, at = [], 0
    for _ in range(groups):
        system, at = text[at:at + system_chars], at + system_chars
        out.append([system + "\n\nUser: " + text[at + i * turn_chars:at + (i + 1) * turn_chars] for i in range(turns)])
        at += turns * turn_chars
    return out


async def drive(addr: str, prompts: list[str], clients: int) -> list[dict]:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    rows: list[dict] = []

    async def client(stub) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            t0, ttft, usage = time.perf_counter(), None, None
            async for msg in stub.GenerateText(pb.GenerateTextRequest(
                    text=prompt, sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True)), timeout=120):
                ttft = ttft or time.perf_counter() - t0
                usage = msg.usage if msg.HasField("usage") else usage
            rows.append({"ttft_ms": 1000 * ttft, "prompt_tokens": usage.prompt_tokens})

    async with grpc.aio.insecure_channel(addr) as ch:
        await asyncio.gather(*[client(pbg.TokenizerServiceStub(ch)) for _ in range(clients)])
    return rows


async def page_layout(addr: str) -> tuple[int, int]:
    async with grpc.aio.insecure_channel(addr) as ch:
        s = await pbg.DecodeServiceStub(ch).GetPoolStats(pb.GetPoolStatsRequest(), timeout=10)
    return s.spec.block_size, s.page_bytes


def run(args: argparse.Namespace, routing: str, convs: list[list[str]]) -> dict:
    stack = Stack(model_dir=args.model_dir, weights=args.weights, decode_pages=args.decode_pages,
                  prefill_pages=args.prefill_pages, decode_replicas=args.decode_replicas, metrics=True,
                  extra={"decode_svc": ALL_REMOTE, "tokenizer_svc": ["--decode-routing", routing]})
    with stack:
        block, page_bytes = asyncio.run(page_layout(stack.addr("decode_svc")))
        warm = [f"warm-up {i}: " + convs[0][0][::-1] for i in range(2 * args.decode_replicas)]
        asyncio.run(drive(stack.addr("tokenizer_svc"), warm, args.clients))  # shares no page with the rest
        decodes = stack.replicas("decode_svc")
        before = {n: metric_value(metrics_text(stack.metrics_ports[n]), "kvwire:kv_transfer_bytes_total")
                  for n in decodes}
        # Turn by turn, conversations shuffled within a turn (a fixed order would let round_robin's
        # strict alternation keep each conversation on one replica by accident).
        rng = random.Random(0)
        prompts = [p for turn in range(args.turns) for p in rng.sample([c[turn] for c in convs], len(convs))]
        t0 = time.perf_counter()
        rows = asyncio.run(drive(stack.addr("tokenizer_svc"), prompts, args.clients))
        wall = time.perf_counter() - t0
        pulled = {n: metric_value(metrics_text(stack.metrics_ports[n]), "kvwire:kv_transfer_bytes_total") - before[n]
                  for n in decodes}
    pages = sum(-(-r["prompt_tokens"] // block) for r in rows)
    ttft = [r["ttft_ms"] for r in rows]
    return {"routing": routing, "requests": len(rows), "prompt_pages": pages,
            "pages_pulled": round(sum(pulled.values()) / page_bytes),
            "hit_rate": 1 - sum(pulled.values()) / (pages * page_bytes),
            "kv_bytes_pulled_per_replica": pulled, "ttft_ms": common.stats(ttft),
            "ttft_median_ms": statistics.median(ttft), "wall_s": wall}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--weights", default="none")
    ap.add_argument("--decode-replicas", type=int, default=2)
    ap.add_argument("--decode-pages", type=int, default=256,
                    help="per decode replica: sized so one replica holds about half the conversations' prefixes")
    ap.add_argument("--prefill-pages", type=int, default=512)
    ap.add_argument("--groups", type=int, default=16, help="conversations, each with its own system prompt")
    ap.add_argument("--turns", type=int, default=4, help="requests per conversation")
    ap.add_argument("--system-chars", type=int, default=1200)
    ap.add_argument("--turn-chars", type=int, default=120)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--out", type=Path, default=common.OUT)
    args = ap.parse_args(argv)
    convs = conversations(args.groups, args.turns, args.system_chars, args.turn_chars)
    runs = [run(args, routing, convs) for routing in ("round_robin", "prefix")]
    report = {"benchmark": "prefix-routing", "model": args.model_dir.name, "weights": args.weights,
              "decode_replicas": args.decode_replicas, "decode_pages": args.decode_pages, "groups": args.groups,
              "turns": args.turns, "clients": args.clients, "runs": runs}
    common.save(report, markdown(report), args.out)
    print(markdown(report))
    return report


def markdown(r: dict) -> str:
    rows = [[x["routing"], x["requests"], x["prompt_pages"], x["pages_pulled"], f"{100 * x['hit_rate']:.1f}%",
             common.fmt(x["ttft_median_ms"]), common.fmt(x["ttft_ms"]["p99"]), common.fmt(x["wall_s"], 2)]
            for x in r["runs"]]
    return (f"Prefix caching across {r['decode_replicas']} decode replicas, model {r['model']} (weights "
            f"{r['weights']}), {r['decode_pages']} KV pages per decode: {r['groups']} conversations x {r['turns']} "
            f"turns, each its own system prompt, sent turn by turn (shuffled within a turn) by {r['clients']} "
            "clients.\n\n"
            + common.table(["routing", "requests", "prompt pages", "pages pulled from prefill", "prefix-cache hit rate",
                            "TTFT median (ms)", "TTFT p99 (ms)", "wall (s)"], rows) + "\n")


if __name__ == "__main__":
    main()
