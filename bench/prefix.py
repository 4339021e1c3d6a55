"""Prefix caching across the split: multi-turn chat with a shared system prompt.

    python -m bench prefix [--model-dir PATH] [--shared 1024] [--turns 6] [--turn-tokens 32]

Method and details: bench/README.md, section ``bench/prefix.py``.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from bench import common
from kvwire import metrics
from kvwire.config import DEFAULT_MODEL_DIR
from kvwire.config import KVDtype, QuantMode
from kvwire.engine.async_engine import AsyncEngine
from kvwire.engine.core import EngineCore
from decode_svc.remote_prefill import RemotePrefill
from kvwire.engine.kv_source import KVSources, LocalPrefill
from kvwire.engine.runner import ModelRunner
from kvwire.runtime import EngineConfig, load_engine
from kvwire.sampling_params import KVSourceChoice, SamplingParams
from kvwire_serving.server import GrpcServer, build_channel
from kvwire.tokenizer import ModelTokenizer
from prefill_svc.runner import PrefillRunner
from prefill_svc.server import PrefillServicer
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg


def prompts(tok: ModelTokenizer, shared: int, turns: int, turn_tokens: int) -> list[list[int]]:
    from tools.train_embedded import load_corpus  # imports transformers (the bench extra)
    _, held, _ = load_corpus()
    ids = [t for text in held for t in tok.encode(text, add_special_tokens=False)]
    if len(ids) < shared + turns * turn_tokens:
        raise SystemExit(f"the held-out corpus has {len(ids)} tokens; lower --shared or --turns")
    system = ids[:shared]
    return [system + ids[shared + i * turn_tokens:shared + (i + 1) * turn_tokens] for i in range(turns)]


async def run(cfg: EngineConfig, reqs: list[list[int]], caching: bool) -> list[dict]:
    runtime = load_engine(cfg)
    prefill = PrefillRunner(runtime, cfg.num_pages, prefix_caching=caching)
    prefill.warm_up()
    server = GrpcServer(tracing=False)
    server.add_service(pbg.add_PrefillServiceServicer_to_server, PrefillServicer(prefill), "kvwire.v1.PrefillService")
    port = await server.start("127.0.0.1:0")
    channel = build_channel(f"127.0.0.1:{port}", tracing=False)
    runner = ModelRunner(runtime, cfg.num_pages, prefix_caching=caching)
    runner.warm_up()
    engine = AsyncEngine(EngineCore(runner), KVSources(LocalPrefill(runner),
                                                       RemotePrefill(runner, pbg.PrefillServiceStub(channel), channel)))
    engine.start()
    rows = []
    try:
        warm = [t ^ 1 for t in reqs[0][:64]]  # shares no page with the measured prompts
        for i, prompt in enumerate([warm, *reqs]):  # the first one only warms the path up
            before = metrics.KV_TRANSFER_BYTES._value.get()
            t0 = time.perf_counter()
            ttft = None
            async for _ in engine.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True),
                                           kv_source=KVSourceChoice.REMOTE):
                ttft = ttft or time.perf_counter() - t0
            if i:
                rows.append({"turn": i, "prompt_tokens": len(prompt), "ttft_ms": 1000 * ttft,
                             "kv_bytes": metrics.KV_TRANSFER_BYTES._value.get() - before})
    finally:
        await engine.close()
        await channel.close()
        await server.stop(0)
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--weights", default="none", choices=[m.value for m in QuantMode])
    ap.add_argument("--kv-dtype", default="fp8_e4m3", choices=[d.value for d in KVDtype])
    ap.add_argument("--shared", type=int, default=1024, help="system prompt tokens, shared by every turn")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--turn-tokens", type=int, default=32, help="new tokens per turn")
    ap.add_argument("--out", type=Path, default=common.OUT)
    args = ap.parse_args(argv)
    cfg = EngineConfig(model_dir=args.model_dir, weights=QuantMode(args.weights), kv_dtype=KVDtype(args.kv_dtype),
                       num_pages=2 * (args.shared + args.turns * args.turn_tokens) // 16 + 64)
    reqs = prompts(ModelTokenizer(args.model_dir), args.shared, args.turns, args.turn_tokens)
    off = asyncio.run(run(cfg, reqs, caching=False))
    on = asyncio.run(run(cfg, reqs, caching=True))
    miss = statistics.median(r["ttft_ms"] for r in off)
    hit = statistics.median(r["ttft_ms"] for r in on[1:])
    report = {"benchmark": "prefix", "model": args.model_dir.name, "weights": args.weights, "kv_dtype": args.kv_dtype,
              "shared_tokens": args.shared, "turn_tokens": args.turn_tokens, "turns": args.turns,
              "cache_off": off, "cache_on": on, "ttft_miss_ms": miss, "ttft_hit_ms": hit,
              "speedup": miss / hit, "kv_bytes_miss": statistics.median(r["kv_bytes"] for r in off),
              "kv_bytes_hit": statistics.median(r["kv_bytes"] for r in on[1:])}
    common.save(report, markdown(report), args.out)
    return report


def markdown(r: dict) -> str:
    rows = [[f"{'on' if mode == 'cache_on' else 'off'}", x["turn"], x["prompt_tokens"], common.fmt(x["ttft_ms"]),
             x["kv_bytes"]] for mode in ("cache_off", "cache_on") for x in r[mode]]
    return (f"Prefix caching across the split, model {r['model']} (weights {r['weights']}, KV {r['kv_dtype']}): "
            f"{r['shared_tokens']}-token shared system prompt + {r['turn_tokens']} new tokens per turn, "
            "one request at a time, KV pulled from prefill_svc over loopback gRPC.\n\n"
            + common.table(["prefix caching", "turn", "prompt tokens", "TTFT (ms)", "KV bytes on the wire"], rows)
            + f"\n\nTTFT median: miss {r['ttft_miss_ms']:.1f} ms, hit {r['ttft_hit_ms']:.1f} ms = "
            f"{r['speedup']:.1f}x faster; KV on the wire per request: miss {r['kv_bytes_miss']:.0f} B, "
            f"hit {r['kv_bytes_hit']:.0f} B ({r['kv_bytes_hit'] / r['kv_bytes_miss']:.3f}x).\n")


if __name__ == "__main__":
    main()
