"""KV page kernels against the PyTorch reference on the same device and pages, in one run: the
compiled Triton kernels on a CUDA device, the C kernels (kvwire_kernels/cpu) on the CPU.

    python -m bench kernels [--device cuda|cpu] [--batches 1,16,64] [--contexts 512,2048,8192] [--prompts 128,512,1024]

On the CPU it also times prefill attention (a prompt's causal GQA over its own fp32 K/V): the C
flash kernel against torch's ``scaled_dot_product_attention``, which it replaces.

Method and details: bench/README.md, section ``bench/kernels.py``.
"""
from __future__ import annotations

import argparse
import statistics
import time
import types
from pathlib import Path

import torch
from tqdm import tqdm

from bench import common, machine
from kvwire_kernels import cpu
from kvwire_kernels import reference as ref

LAYOUTS = {"smollm2-135m": (3, 3, 64), "tinyllama-1.1b": (4, 8, 64), "llama3-8b": (8, 4, 128)}  # Hkv, ratio, D
BLOCK = 16
DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16}


def time_ms(fn, warmup: int = 5, iters: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if not torch.cuda.is_available():
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def kernels(device: str):
    """The module-like object with the reference's two signatures for ``device``."""
    if device.startswith("cuda"):
        from kvwire_kernels import triton_kv  # triton: a GPU-only dependency (the test extra)
        return triton_kv
    if not cpu.available():
        raise SystemExit(f"the CPU kernels are not available here: {cpu.unavailable_reason}")
    return types.SimpleNamespace(paged_decode_attention=cpu.paged_attention,
                                 write_kv=lambda *a: cpu.write_kv(*a[:4], a[4].float(), a[5].float(), a[6].long()))


def pages(n: int, hkv: int, d: int, dtype: torch.dtype, dev: str):
    """n pages written as the engine writes them (the reference's write_kv) from Gaussian K and V.
    Not random bytes: one byte in 16 would be an e4m3 subnormal, which the CPU kernel widens through
    an fp32 subnormal (a microcode assist that slows attention several times); a real model's pages
    hold about one in 8,000 (SmolLM2-135M, 1,024-token prompt), Gaussian values one in 17,000."""
    shape = (n, hkv, BLOCK, d)
    state = [torch.zeros(shape, device=dev, dtype=dtype), torch.zeros(shape, device=dev, dtype=dtype)]
    if dtype == torch.bfloat16:
        state += [None, None]
    else:
        state += [torch.zeros(shape[:3], device=dev, dtype=torch.bfloat16) for _ in range(2)]
    for first in range(0, n, 4096):  # a few thousand pages at a time: bounded float32 temporaries
        m = min(4096, n - first)
        kv = torch.randn(2, m * BLOCK, hkv, d, device=dev)
        ref.write_kv(*state, kv[0], kv[1], torch.arange(first * BLOCK, (first + m) * BLOCK, device=dev))
    return state


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
    for name, fn in (("kernel", tk.paged_decode_attention), ("reference", ref.paged_decode_attention)):
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
    for name, fn in (("kernel", tk.write_kv), ("reference", ref.write_kv)):
        res[f"{name}_ms"] = time_ms(lambda fn=fn: fn(*state, k, v, slots))
    return res


def prefill_case(layout: str, n: int) -> dict:
    from kvwire.kv.dense import sdpa_gqa
    hkv, ratio, d = LAYOUTS[layout]
    q, k, v = torch.randn(n, hkv * ratio, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    kernel = time_ms(lambda: cpu.prefill_attention(q, k, v, 0, 0, None, d ** -0.5))
    torch_ms = time_ms(lambda: sdpa_gqa(q, k, v, None, causal=True))
    flops = 2 * 2 * hkv * ratio * d * n * (n + 1) / 2  # QK and PV over the causal triangle
    return {"layout": layout, "tokens": n, "kernel_ms": kernel, "sdpa_ms": torch_ms,
            "kernel_gflops": flops / kernel / 1e6, "sdpa_gflops": flops / torch_ms / 1e6}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default=None, help="default 1,16,64 on a GPU, 1,16 on the CPU")
    ap.add_argument("--contexts", default=None, help="default 512,2048,8192 on a GPU, 512,2048 on the CPU")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--kv", default="fp8_e4m3,bf16")
    ap.add_argument("--prompts", default="128,512,1024", help="prompt lengths for prefill attention (CPU only)")
    ap.add_argument("--out", type=Path, default=common.OUT)
    args = ap.parse_args(argv)
    gpu = args.device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device here")
    args.batches = args.batches or ("1,16,64" if gpu else "1,16")
    args.contexts = args.contexts or ("512,2048,8192" if gpu else "512,2048")
    tk = kernels(args.device)

    torch.manual_seed(0)
    facts = machine.facts(device=args.device)
    layouts, kvs = args.layouts.split(","), args.kv.split(",")
    grid = [(lay, kv, int(b), int(c)) for lay in layouts for kv in kvs
            for b in args.batches.split(",") for c in args.contexts.split(",")]
    attn = [attention_case(tk, *g, args.device) for g in tqdm(grid, desc="attention cases")]
    writes = [write_case(tk, lay, kv, t, args.device) for lay in layouts for kv in kvs
              for t in (max(int(b) for b in args.batches.split(",")), 8 * 512)]
    report = {"benchmark": "kernels", "model": "kv-layouts", "device": args.device,
              "kernel": "Triton (compiled)" if gpu else "kvwire_kernels/cpu (C)", "machine": facts,
              "attention": attn, "writes": writes,
              "prefill": [] if gpu or not cpu.available() else
              [prefill_case(lay, int(n)) for lay in layouts for n in tqdm(args.prompts.split(","), desc=f"prefill {lay}")]}
    common.save(report, markdown(report), args.out)
    print(markdown(report))
    return report


def markdown(report: dict) -> str:
    f, m = common.fmt, report["machine"]
    bw = machine.roofline_gbs(m)
    rows = [[r["layout"], r["kv"], r["batch"], r["context"], f(r["kv_mb"], 1), f(r.get("kernel_ms"), 3),
             f(r.get("kernel_gbs"), 0), f"{100 * r['kernel_gbs'] / bw:.0f}%" if r.get("kernel_gbs") else "-",
             f(r.get("reference_ms"), 3), common.ratio(r.get("reference_ms"), r.get("kernel_ms"))]
            for r in report["attention"]]
    lines = [f"Kernels: {report.get('kernel', 'Triton (compiled)')} on {report.get('device', 'cuda')}.",
             machine.describe(m), "",
             "Decode attention, one query per sequence (all heads), pages of 16 tokens in random order:", "",
             common.table(["layout", "KV", "batch", "context", "KV MB read", "kernel ms", "kernel GB/s",
                           "% of read bandwidth", "reference ms", "kernel speedup"], rows), "",
             "KV writes (quantize + scatter into pages, one layer's K and V):", "",
             common.table(["layout", "KV", "tokens", "kernel ms", "reference ms", "kernel speedup"],
                          [[w["layout"], w["kv"], w["tokens"], f(w["kernel_ms"], 3), f(w["reference_ms"], 3),
                            common.ratio(w["reference_ms"], w["kernel_ms"])] for w in report["writes"]])]
    if report.get("prefill"):
        lines += ["", "Prefill attention (one prompt, causal GQA over its own fp32 K/V; GFLOP/s over the causal "
                  "triangle):", "",
                  common.table(["layout", "tokens", "kernel ms", "kernel GFLOP/s", "torch sdpa ms", "sdpa GFLOP/s",
                                "kernel speedup"],
                               [[p["layout"], p["tokens"], f(p["kernel_ms"], 3), f(p["kernel_gflops"], 0),
                                 f(p["sdpa_ms"], 3), f(p["sdpa_gflops"], 0), common.ratio(p["sdpa_ms"], p["kernel_ms"])]
                                for p in report["prefill"]])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
