"""Resident memory of the serving processes against what they must hold: weights + KV pool.

    python -m bench memory --model smollm2-135m-instruct
    python -m bench memory --shape tinyllama-1.1b        # random weights of a real shape (bench/shapes.py)
    python -m bench memory --shape tinyllama-1.1b --weights gguf --shape-gguf q4_k_m   # that shape in 4 bits

Method and details: bench/README.md, section ``bench/memory.py``.
"""
from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import grpc

from bench import common, shapes
from bench.disagg import prompt_ids, served
from kvwire.config import KVDtype, QuantMode
from kvwire.model.registry import resolve_model_path
from kvwire.runtime import EngineConfig, load_engine
from kvwire.tokenizer import ModelTokenizer
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from tools.stack import Stack, proc_memory_mb

MB = 1 << 20


def weight_mb(model_dir: Path, weights: str, kv_dtype: str) -> float:
    """The loaded model's tensor bytes (parameters and buffers), as a service holds them."""
    rt = load_engine(EngineConfig(model_dir=model_dir, weights=QuantMode(weights), kv_dtype=KVDtype(kv_dtype),
                                  num_pages=1))
    return sum(t.numel() * t.element_size() for t in rt.model.state_dict().values()) / MB


async def pool_mb(stack: Stack) -> dict[str, float]:
    async with grpc.aio.insecure_channel(stack.addr("decode_svc")) as ch:
        d = await pbg.DecodeServiceStub(ch).GetPoolStats(pb.GetPoolStatsRequest())
    async with grpc.aio.insecure_channel(stack.addr("prefill_svc")) as ch:
        p = await pbg.PrefillServiceStub(ch).GetPrefillPoolStats(pb.GetPrefillPoolStatsRequest())
    return {"decode_svc": d.total_pages * d.page_bytes / MB, "prefill_svc": p.total_pages * p.page_bytes / MB}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a registered model name or a model directory / .gguf")
    src.add_argument("--shape", choices=sorted(shapes.SHAPES), help="random weights of a real shape")
    ap.add_argument("--models-dir", type=Path, default=common.MODELS, help="where --shape models are written")
    ap.add_argument("--weights", default=QuantMode.INT8.value, choices=[m.value for m in QuantMode])
    ap.add_argument("--kv-dtype", default=KVDtype.FP8_E4M3.value, choices=[d.value for d in KVDtype])
    ap.add_argument("--shape-gguf", choices=["q4_k_m", "q8_0"], default="q4_k_m",
                    help="with --shape and --weights gguf: the shape's GGUF made by llama.cpp's quantizer "
                         "(needs the peers extra)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--out", type=Path, default=common.OUT)
    args = ap.parse_args(argv)
    model = shapes.build(args.shape, args.models_dir) if args.shape else resolve_model_path(args.model)
    if args.shape and args.weights == QuantMode.GGUF.value:
        from bench import llamacpp
        model = llamacpp.gguf_for(model, args.shape_gguf)
    if args.shape:
        ids = [100 + i % 1000 for i in range(args.prompt_len)]
    else:
        ids = prompt_ids(ModelTokenizer(model), args.prompt_len)
    weights = weight_mb(model, args.weights, args.kv_dtype)
    with Stack(model_dir=model, weights=args.weights, kv_dtype=args.kv_dtype,
               services=("prefill_svc", "decode_svc")) as stack:
        for i in range(args.requests):
            source = pb.KV_SOURCE_LOCAL if i % 2 == 0 else pb.KV_SOURCE_REMOTE
            asyncio.run(served(stack.addr("decode_svc"), ids, 16, source))
        pools = asyncio.run(pool_mb(stack))
        status = {name: proc_memory_mb(stack.procs[name].pid) for name in pools}
    rows = []
    for name, pool in pools.items():
        held = weights + pool
        rows.append({"process": name, "rss_mb": round(status[name]["VmRSS"], 1),
                     "peak_mb": round(status[name]["VmHWM"], 1), "weights_mb": round(weights, 1),
                     "pool_mb": round(pool, 1), "runtime_mb": round(status[name]["VmHWM"] - held, 1),
                     "peak_over_weights_and_pool": round(status[name]["VmHWM"] / held, 2)})
        print(rows[-1], flush=True)
    name = args.shape + (f" ({args.shape_gguf})" if args.weights == QuantMode.GGUF.value else "") if args.shape \
        else Path(args.model).stem
    report = {"benchmark": "memory", "model": name, "weights": args.weights,
              "kv_dtype": args.kv_dtype, "requests": args.requests, "prompt_len": args.prompt_len, "rows": rows}
    common.save(report, markdown(report), args.out)
    return report


def markdown(report: dict) -> str:
    cols = ["process", "rss_mb", "peak_mb", "weights_mb", "pool_mb", "runtime_mb", "peak_over_weights_and_pool"]
    return (f"Model {report['model']}, {report['weights']} weights, KV {report['kv_dtype']}, after "
            f"{report['requests']} requests of {report['prompt_len']} prompt tokens (local prefill and page "
            "stream alternating). runtime = peak - weights - pool.\n\n"
            + common.table(cols, [[r[c] for c in cols] for r in report["rows"]]) + "\n")


if __name__ == "__main__":
    main()
