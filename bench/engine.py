"""Engine benchmark: batch-1 prefill and decode tokens/s, ours against transformers on the same weights.

    python -m bench.engine --model tinyllama-1.1b --prompt-len 512 --decode-tokens 32

Builds the random-weight model locally (bench/shapes.py), measures the machine's memory bandwidth
in the same run, and reports each decode figure as a share of the bandwidth roofline
(weight bytes read per token / bandwidth). Writes JSON and a markdown table under bench/out/.
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench import machine, shapes
from core.config import DType, QuantMode
from core.kv.dense import DenseKVCache
from core.model.loader import load_model

OUT = Path(__file__).parent / "out"


@dataclass
class Result:
    engine: str
    prefill_tok_s: float
    decode_tok_s: float
    weight_bytes_per_token: int
    roofline_tok_s: float
    roofline_pct: float


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every linear's stored weights (the embedding reads one row)."""
    total = 0
    for name, mod in model.named_modules():
        if name.endswith(("qkv", ".o", "gate_up", "down", "lm_head")):
            total += sum(t.numel() * t.element_size() for t in list(mod.parameters()) + list(mod.buffers()))
    return total


def time_ours(model_dir: Path, dtype: DType, quant: QuantMode, prompt: torch.Tensor, n_decode: int):
    loaded = load_model(model_dir, dtype=dtype, progress=True)
    model = loaded.model
    if quant not in (QuantMode.NONE, QuantMode.BF16):
        from core.model.quant import quantize_model
        model = quantize_model(model, quant)
    n = prompt.numel()

    def run(decode_steps: int) -> tuple[float, float]:
        cache = DenseKVCache(loaded.config, 1, n + decode_steps + 1, dtype=torch.float32)
        t0 = time.perf_counter()
        logits = model(prompt, cache.prepare([0], [n]), cache, logits_rows=torch.tensor([n - 1]))
        tok = int(logits[0].argmax())
        t1 = time.perf_counter()
        for _ in range(decode_steps):
            logits = model(torch.tensor([tok]), cache.prepare([0], [1]), cache)
            tok = int(logits[0].argmax())
        return t1 - t0, time.perf_counter() - t1

    run(2)  # warm up allocator and kernels
    prefill_s, decode_s = run(n_decode)
    wbytes = linear_weight_bytes(model)
    del model, loaded
    gc.collect()
    return n / prefill_s, n_decode / decode_s, wbytes


def time_transformers(model_dir: Path, dtype: torch.dtype, prompt: torch.Tensor, n_decode: int):
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ids = prompt[None]
    mask = torch.ones_like(ids)

    def gen(k: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                        pad_token_id=0)
        return time.perf_counter() - t

    gen(2)
    first = gen(1)  # prefill + one token
    total = gen(n_decode + 1)
    wbytes = linear_weight_bytes_hf(hf)
    del hf
    gc.collect()
    return prompt.numel() / first, n_decode / (total - first), wbytes


def linear_weight_bytes_hf(hf) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in hf.modules()
               if isinstance(m, torch.nn.Linear))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tinyllama-1.1b", choices=sorted(shapes.SHAPES))
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--ours", default="bf16,fp32", help="comma list of weight modes: fp32,bf16,int8,fp8")
    ap.add_argument("--peers", default="transformers-fp32,transformers-bf16",
                    help="comma list: transformers-fp32, transformers-bf16 (empty for none)")
    ap.add_argument("--models-dir", type=Path, default=Path(__file__).parent / ".models")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)

    model_dir = shapes.build(args.model, args.models_dir)
    facts = machine.facts()
    bw = facts["memory_bandwidth_gbs"] * 1e9
    prompt = torch.randint(3, shapes.SHAPES[args.model]["vocab_size"], (args.prompt_len,),
                           generator=torch.Generator().manual_seed(0))
    results = []
    for mode in filter(None, args.ours.split(",")):
        dtype = DType.FP32 if mode == "fp32" else DType.BF16
        quant = QuantMode.NONE if mode in ("fp32", "bf16") else QuantMode(mode)
        p, d, wb = time_ours(model_dir, dtype, quant, prompt, args.decode_tokens)
        results.append(Result(f"kvwire {mode}", p, d, wb, bw / wb, 100 * d / (bw / wb)))
        print(results[-1], flush=True)
    for peer in filter(None, args.peers.split(",")):
        dtype = torch.float32 if peer.endswith("fp32") else torch.bfloat16
        p, d, wb = time_transformers(model_dir, dtype, prompt, args.decode_tokens)
        results.append(Result(peer, p, d, wb, bw / wb, 100 * d / (bw / wb)))
        print(results[-1], flush=True)

    report = {"benchmark": "engine", "model": args.model, "prompt_len": args.prompt_len,
              "decode_tokens": args.decode_tokens, "machine": facts, "results": [asdict(r) for r in results]}
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (args.out / f"engine-{args.model}-{stamp}.json").write_text(json.dumps(report, indent=2))
    md = markdown(report)
    (args.out / f"engine-{args.model}-{stamp}.md").write_text(md)
    print(md)
    return report


def markdown(report: dict) -> str:
    rows = report["results"]
    base = {r["engine"]: r for r in rows}
    peer = base.get("transformers-fp32") or (rows[-1] if rows else None)
    lines = [f"Model {report['model']} (random weights), batch 1, prompt {report['prompt_len']}, "
             f"{report['decode_tokens']} decode tokens; memory bandwidth "
             f"{report['machine']['memory_bandwidth_gbs']} GB/s measured in the same run.", "",
             "| engine | prefill tok/s | decode tok/s | weight MB/token | roofline tok/s | % of roofline "
             f"| prefill vs {peer['engine'] if peer else '-'} | decode vs {peer['engine'] if peer else '-'} |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rp = f"{r['prefill_tok_s'] / peer['prefill_tok_s']:.2f}x" if peer else "-"
        rd = f"{r['decode_tok_s'] / peer['decode_tok_s']:.2f}x" if peer else "-"
        lines.append(f"| {r['engine']} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.2f} | "
                     f"{r['weight_bytes_per_token'] / 1e6:.0f} | {r['roofline_tok_s']:.2f} | "
                     f"{r['roofline_pct']:.0f}% | {rp} | {rd} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
