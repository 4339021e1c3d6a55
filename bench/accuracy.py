"""Accuracy cost of every weight x KV mode on the embedded model's held-out text.

    python -m bench accuracy [--model-dir models/kvwire-tiny] [--max-tokens 16384]

For weights {bf16, int8, fp8} x KV pages {bf16, fp8}:
  - perplexity over held-out windows (the topics tools/train_embedded.py held out). Each window is
    fed as a 32-token prompt and then 16-token chunks, so every later query reads the *paged* KV
    (quantized for fp8), as decoding does; a single prefill would never read the pages;
  - greedy agreement with bf16/bf16 over 256 generated tokens for 20 held-out prompts:
    teacher-forced top-1 agreement on bf16/bf16's tokens, and the mean length of the identical
    free-running prefix.
Budgets (issue 3): int8 weights +1% perplexity, fp8 weights +2%, fp8 KV alone +0.5%.
Writes bench/out/accuracy-<model>-<stamp>.{json,md}.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from tqdm import tqdm

from bench import common
from kvwire.cli import DEFAULT_MODEL_DIR
from kvwire.config import KVDtype, QuantMode
from kvwire.generate import generate
from kvwire.runtime import EngineConfig, load_engine
from kvwire.sampling import SamplingParams
from kvwire.tokenizer import ModelTokenizer
from tools.train_embedded import load_corpus

OUT = common.OUT
WEIGHTS = (QuantMode.BF16, QuantMode.INT8, QuantMode.FP8)
KVS = (KVDtype.BF16, KVDtype.FP8_E4M3)
BUDGET = {QuantMode.BF16: 0.0, QuantMode.INT8: 1.0, QuantMode.FP8: 2.0}  # % perplexity, weights alone
KV_BUDGET = 0.5


@torch.inference_mode()
def chunked_logits(engine, ids: list[int], first: int = 32, chunk: int = 16) -> torch.Tensor:
    """Logits [len(ids), vocab] computed prompt-then-chunks through a fresh paged cache."""
    cache = engine.new_cache(engine.spec.pages_for(len(ids)) + 2)
    out, start = [], 0
    while start < len(ids):
        n = first if start == 0 else min(chunk, len(ids) - start)
        positions = cache.prepare([0], [n])
        out.append(engine.model(torch.tensor(ids[start:start + n]), positions, cache))
        start += n
    return torch.cat(out)


def perplexity(engine, windows: list[list[int]]) -> float:
    nll, count = 0.0, 0
    for w in windows:
        logp = torch.log_softmax(chunked_logits(engine, w)[:-1].float(), dim=-1)
        nll -= logp.gather(1, torch.tensor(w[1:])[:, None]).sum().item()
        count += len(w) - 1
    return math.exp(nll / count)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16384, help="held-out tokens scored per mode")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)

    tok = ModelTokenizer(args.model_dir)
    _, held, _ = load_corpus()
    stream = [t for text in held for t in tok.encode(text)][:args.max_tokens]
    windows = [stream[i:i + args.window] for i in range(0, len(stream) - args.window + 1, args.window)]
    prompts = [w[:32] for w in windows[::max(1, len(windows) // args.prompts)][:args.prompts]]

    results, reference = {}, None
    modes = [(w, kv) for w in WEIGHTS for kv in KVS]
    for w, kv in tqdm(modes, desc="modes"):
        engine = load_engine(EngineConfig(model_dir=args.model_dir, weights=w, kv_dtype=kv))
        ppl = perplexity(engine, windows)
        gens = [generate(engine.model, p, SamplingParams(max_tokens=args.gen, ignore_eos=True),
                         cache=engine.new_cache(engine.spec.pages_for(len(p) + args.gen) + 2)) for p in prompts]
        if reference is None:
            reference = gens
        same_prefix, agree, total = [], 0, 0
        for p, g, ref in zip(prompts, gens, reference):
            same_prefix.append(next((i for i, (a, b) in enumerate(zip(g, ref)) if a != b), len(ref)))
            pred = chunked_logits(engine, p + ref)[len(p) - 1:-1].argmax(-1)  # teacher-forced on bf16/bf16
            agree += int((pred == torch.tensor(ref)).sum())
            total += len(ref)
        results[f"{w.value}/{kv.value}"] = {"weights": w.value, "kv": kv.value, "perplexity": ppl,
                                            "teacher_forced_agreement": agree / total,
                                            "mean_identical_prefix": sum(same_prefix) / len(same_prefix)}
        tqdm.write(f"{w.value}/{kv.value}: {results[f'{w.value}/{kv.value}']}")

    report = {"benchmark": "accuracy", "model": str(args.model_dir.name), "held_out_tokens": len(windows) * args.window,
              "windows": len(windows), "prompts": len(prompts), "generated": args.gen, "results": results}
    common.save(report, markdown(report), args.out)
    return report


def markdown(report: dict) -> str:
    r = report["results"]
    base = r["bf16/bf16"]["perplexity"]
    lines = [f"Model {report['model']}, {report['held_out_tokens']} held-out tokens in {report['windows']} windows; "
             f"greedy agreement over {report['generated']} tokens for {report['prompts']} held-out prompts.", "",
             "| weights | KV | perplexity | vs bf16/bf16 | budget | teacher-forced agreement | identical prefix (tokens) |",
             "|---|---|---|---|---|---|---|"]
    for key, v in r.items():
        w, kv = QuantMode(v["weights"]), KVDtype(v["kv"])
        budget = BUDGET[w] + (KV_BUDGET if kv == KVDtype.FP8_E4M3 else 0.0)
        delta = 100 * (v["perplexity"] / base - 1)
        ok = "within" if delta <= budget + 1e-9 else "MISSED"
        lines.append(f"| {v['weights']} | {v['kv']} | {v['perplexity']:.3f} | {delta:+.2f}% | "
                     f"+{budget:.1f}% ({ok}) | {v['teacher_forced_agreement']:.3f} | {v['mean_identical_prefix']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
