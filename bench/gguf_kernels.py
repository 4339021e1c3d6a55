"""GGUF block matmuls against a bf16 matmul of the same (dequantized) weight, on a model's linear shapes.

    python -m bench gguf-kernels [--device cuda|cpu] [--model tinyllama-1.1b] [--types Q4_0,Q4_K,...]
                                 [--rows 1,16,64,512] [--layers qkv,o,gate_up,down,lm_head]

On a CUDA device: ``kvwire_kernels.triton_gguf.linear`` (compiled Triton, W4A16: bf16 activations,
the weight read as stored) against ``torch.nn.functional.linear`` on the bf16 weight (cuBLAS). On
the CPU: the C kernel ``kvwire_kernels.cpu.gemm_gguf`` (int8 activation blocks) against torch's bf16
matmul. Per case: time per call (CUDA events / perf_counter, the median of 20 after 5), the weight's
bytes over that time (GB/s: what a decode step streams), the speedup over bf16, and the largest
error against the fp32 product of the dequantized weight (relative to the output's largest value).
Weights are random blocks with small fp16 scales (the time does not depend on the values).
Method: bench/README.md, section ``bench/gguf_kernels.py``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from bench import common, machine
from bench.kernels import time_ms
from bench.shapes import SHAPES
from kvwire_kernels import cpu, reference

TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
SCALES = {"Q4_0": (0, 1), "Q4_1": (0, 2), "Q8_0": (0, 1), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, 1)}  # (byte, fp16s)


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """Our fused Linears of ``model`` (bench/shapes.py) as (out, in)."""
    s = SHAPES[model]
    h, inter, heads, kv = s["hidden_size"], s["intermediate_size"], s["num_attention_heads"], s["num_key_value_heads"]
    d = h // heads
    return {"qkv": ((heads + 2 * kv) * d, h), "o": (h, heads * d), "gate_up": (2 * inter, h), "down": (h, inter),
            "lm_head": (s["vocab_size"], h)}


def random_raw(qtype: str, out: int, n_in: int, g: torch.Generator) -> torch.Tensor:
    """uint8 [out, in / values * bytes]: random bytes, the fp16 scales set in [1e-5, 1e-4)."""
    values, size = reference.GGUF_BLOCK_SIZES[qtype]
    raw = torch.randint(0, 256, (out, n_in // values, size), dtype=torch.uint8, generator=g)
    at, n = SCALES[qtype]
    scales = (torch.rand(out, n_in // values, n, generator=g) * 9e-5 + 1e-5).half()
    raw[..., at:at + 2 * n] = scales.view(torch.uint8)
    return raw.reshape(out, -1)


def cases(layer: str, out: int, n_in: int, qtype: str, rows: list[int], dev: str, g: torch.Generator) -> list[dict]:
    """One weight of ``qtype`` [out, in], timed at each number of activation rows."""
    raw = random_raw(qtype, out, n_in, g).to(dev)
    w32 = reference.dequantize_gguf(raw, qtype)  # [out, in] fp32, on the device
    w16 = w32.to(torch.bfloat16)
    if dev.startswith("cuda"):
        from kvwire_kernels import triton_gguf  # triton: a GPU-only dependency (the test extra)
        run = lambda x: triton_gguf.linear(x.to(torch.bfloat16), raw, qtype, out_dtype=torch.float32)  # noqa: E731
    else:
        packed = cpu.pack_gguf(raw, qtype)
        run = lambda x: cpu.gemm_gguf(x, packed, qtype)  # noqa: E731
    res = []
    for r in rows:
        x = torch.randn(r, n_in, generator=g).to(dev)
        want = x @ w32.T
        err = float((run(x) - want).abs().max() / want.abs().max())
        x16 = x.to(torch.bfloat16)  # both sides timed from 16-bit activations on the GPU
        k_ms = time_ms(lambda: run(x16 if dev.startswith("cuda") else x))
        b_ms = time_ms(lambda: F.linear(x16, w16))
        res.append({"layer": layer, "out": out, "in": n_in, "type": qtype, "rows": r, "weight_mb": raw.numel() / 1e6,
                    "kernel_ms": k_ms, "kernel_gbs": raw.numel() / k_ms / 1e6, "bf16_ms": b_ms,
                    "bf16_gbs": 2 * out * n_in / b_ms / 1e6, "max_rel_err": err})
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench gguf-kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="tinyllama-1.1b", choices=sorted(SHAPES))
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--rows", default=None, help="activation rows; default 1,16,64,512 on a GPU, 1,16 on the CPU")
    ap.add_argument("--layers", default="qkv,o,gate_up,down,lm_head")
    ap.add_argument("--out", type=Path, default=common.OUT)
    args = ap.parse_args(argv)
    gpu = args.device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device here")
    if not gpu and not cpu.available():
        raise SystemExit(f"the CPU kernels are not available here: {cpu.unavailable_reason}")
    rows = [int(r) for r in (args.rows or ("1,16,64,512" if gpu else "1,16")).split(",")]
    shapes = layer_shapes(args.model)
    g = torch.Generator().manual_seed(0)
    grid = [(lay, *shapes[lay], q) for lay in args.layers.split(",") for q in args.types.split(",")
            if shapes[lay][1] % reference.GGUF_BLOCK_SIZES[q][0] == 0 and shapes[lay][0] % 16 == 0]
    results = [c for w in tqdm(grid, desc="gguf weights") for c in cases(*w, rows, args.device, g)]
    report = {"benchmark": "gguf-kernels", "model": args.model, "device": args.device,
              "kernel": "Triton W4A16 (compiled)" if gpu else "kvwire_kernels/cpu (C, int8 activation blocks)",
              "machine": machine.facts(device=args.device), "cases": results}
    common.save(report, markdown(report), args.out)
    print(markdown(report))
    return report


def markdown(report: dict) -> str:
    f = common.fmt
    rows = [[c["layer"], f"{c['out']}x{c['in']}", c["type"], c["rows"], f(c["weight_mb"], 1), f(c["kernel_ms"], 3),
             f(c["kernel_gbs"], 0), f(c["bf16_ms"], 3), f(c["bf16_gbs"], 0), common.ratio(c["bf16_ms"], c["kernel_ms"]),
             f"{c['max_rel_err']:.1e}"] for c in report["cases"]]
    return "\n".join([f"Kernels: GGUF blocks, {report['kernel']} on {report['device']}, {report['model']} linear shapes "
                      "(out x in), against a bf16 matmul of the dequantized weight.", machine.describe(report["machine"]),
                      "", common.table(["layer", "shape", "type", "rows", "weight MB", "kernel ms", "kernel GB/s",
                                        "bf16 ms", "bf16 GB/s", "kernel speedup", "max rel err"], rows)]) + "\n"


if __name__ == "__main__":
    main()
