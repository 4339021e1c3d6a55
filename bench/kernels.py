"""KV page kernels on a CUDA device: the compiled Triton kernels against the PyTorch reference on
the same GPU, same pages, in one run.

    python -m bench kernels [--device cuda] [--batches 1,16,64] [--contexts 512,2048,8192]

For each model's head layout (SmolLM2-135M, TinyLlama-1.1B, Llama-3-8B) and KV dtype:
  - decode attention: b sequences of c positions each, one query per sequence (all heads), time
    per call and the KV bytes it must read (values and, for FP8, scales) per second, against the
    read bandwidth measured in this run;
  - writes: one decode step's b tokens, and a prefill of b x 512 tokens, per layer.
Timed with CUDA events (the median of 20 calls after 5 untimed ones). Triton has no CPU backend,
so this benchmark needs a GPU; on CPU the attention runs in kvwire_kernels/cpu (bench engine).
"""
from __future__ import annotations

import argparse
import statistics

import torch
from tqdm import tqdm

from bench import common, machine
from kvwire_kernels import reference as ref

LAYOUTS = {"smollm2-135m": (3, 3, 64), "tinyllama-1.1b": (4, 8, 64), "llama3-8b": (8, 4, 128)}  # Hkv, ratio, D
BLOCK = 16
DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16}


def time_ms(fn, warmup: int = 5, iters: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def pages(n: int, hkv: int, d: int, dtype: torch.dtype, dev: str):
    shape = (n, hkv, BLOCK, d)
    if dtype == torch.bfloat16:
        return [torch.randn(shape, device=dev, dtype=dtype), torch.randn(shape, device=dev, dtype=dtype), None, None]
    vals = [torch.randint(0, 0x7E, shape, dtype=torch.uint8, device=dev).view(dtype) for _ in range(2)]
    scales = [torch.rand(shape[:3], device=dev).add(0.5).to(torch.bfloat16) for _ in range(2)]
    return [*vals, *scales]


def attention_case(tk, layout: str, kv: str, b: int, c: int, dev: str) -> dict:
    hkv, ratio, d = LAYOUTS[layout]
    dtype = DTYPES[kv]
    nb = -(-c // BLOCK)
    state = pages(b * nb, hkv, d, dtype, dev)
    tables = torch.randperm(b * nb, device=dev, dtype=torch.int32).view(b, nb)
    ctx = torch.full((b,), c, dtype=torch.int32, device=dev)
    q = torch.randn(b, hkv * ratio, d, device=dev)
    args = (q, *state, tables, ctx, None, d ** -0.5)
    kv_bytes = b * c * hkv * (2 * d * dtype.itemsize + (4 if kv == "fp8_e4m3" else 0))
    res = {"layout": layout, "kv": kv, "batch": b, "context": c, "kv_mb": kv_bytes / 1e6}
    for name, fn in (("triton", tk.paged_decode_attention), ("reference", ref.paged_decode_attention)):
        try:
            ms = time_ms(lambda fn=fn: fn(*args))
            res |= {f"{name}_ms": ms, f"{name}_gbs": kv_bytes / ms / 1e6}
        except torch.OutOfMemoryError:
            res[f"{name}_ms"] = None
            torch.cuda.empty_cache()
    return res


def write_case(tk, layout: str, kv: str, tokens: int, dev: str) -> dict:
    hkv, _, d = LAYOUTS[layout]
    dtype = DTYPES[kv]
    n = -(-tokens // BLOCK) + 1
    state = pages(n, hkv, d, dtype, dev)
    k, v = torch.randn(tokens, hkv, d, device=dev), torch.randn(tokens, hkv, d, device=dev)
    slots = torch.randperm(n * BLOCK, device=dev)[:tokens]
    res = {"layout": layout, "kv": kv, "tokens": tokens}
    for name, fn in (("triton", tk.write_kv), ("reference", ref.write_kv)):
        res[f"{name}_ms"] = time_ms(lambda fn=fn: fn(*state, k, v, slots))
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--kv", default="fp8_e4m3,bf16")
    ap.add_argument("--out", type=__import__("pathlib").Path, default=common.OUT)
    args = ap.parse_args(argv)
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        raise SystemExit("bench kernels times the Triton kernels, which need a CUDA device (none here)")
    from kvwire_kernels import triton_kv as tk

    torch.manual_seed(0)
    facts = machine.facts(device=args.device)
    layouts, kvs = args.layouts.split(","), args.kv.split(",")
    grid = [(lay, kv, int(b), int(c)) for lay in layouts for kv in kvs
            for b in args.batches.split(",") for c in args.contexts.split(",")]
    attn = [attention_case(tk, *g, args.device) for g in tqdm(grid, desc="attention cases")]
    writes = [write_case(tk, lay, kv, t, args.device) for lay in layouts for kv in kvs
              for t in (max(int(b) for b in args.batches.split(",")), 8 * 512)]
    report = {"benchmark": "kernels", "model": "kv-layouts", "machine": facts, "attention": attn, "writes": writes}
    common.save(report, markdown(report), args.out)
    print(markdown(report))
    return report


def markdown(report: dict) -> str:
    f, bw = common.fmt, report["machine"]["gpu_read_bandwidth_gbs"]
    rows = [[r["layout"], r["kv"], r["batch"], r["context"], f(r["kv_mb"], 1), f(r.get("triton_ms"), 3),
             f(r.get("triton_gbs"), 0), f"{100 * r['triton_gbs'] / bw:.0f}%" if r.get("triton_gbs") else "-",
             f(r.get("reference_ms"), 3), common.ratio(r.get("reference_ms"), r.get("triton_ms"))]
            for r in report["attention"]]
    lines = [machine.describe(report["machine"]), "",
             "Decode attention, one query per sequence (all heads), pages of 16 tokens in random order:", "",
             common.table(["layout", "KV", "batch", "context", "KV MB read", "Triton ms", "Triton GB/s",
                           "% of read bandwidth", "reference ms", "Triton speedup"], rows), "",
             "KV writes (quantize + scatter into pages, one layer's K and V):", "",
             common.table(["layout", "KV", "tokens", "Triton ms", "reference ms", "Triton speedup"],
                          [[w["layout"], w["kv"], w["tokens"], f(w["triton_ms"], 3), f(w["reference_ms"], 3),
                            common.ratio(w["reference_ms"], w["triton_ms"])] for w in report["writes"]])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
