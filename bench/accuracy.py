"""Accuracy cost of every weight x KV mode on held-out real text, next to llama.cpp's.

    python -m bench accuracy --model smollm2-135m-instruct     # a registered model (fetched if needed)
    python -m bench accuracy --model-dir PATH                  # an HF directory or a .gguf
    python -m bench accuracy                                   # the embedded model

Method and details: bench/README.md, section ``bench/accuracy.py``.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench import common, llamacpp
from kvwire.config import DEFAULT_MODEL_DIR
from kvwire.config import KVDtype, QuantMode
from kvwire.generate import generate
from kvwire.kv.spec import KVPageSpec
from kvwire.model.awq import CALIBRATION
from kvwire.model.registry import fetch
from kvwire.runtime import EngineConfig, load_engine
from kvwire.sampling_params import SamplingParams
from kvwire.tokenizer import ModelTokenizer
from tools.train_embedded import load_corpus

OUT = common.OUT
WEIGHTS = (QuantMode.BF16, QuantMode.INT8, QuantMode.FP8)
KVS = (KVDtype.BF16, KVDtype.FP8_E4M3)
# % perplexity, weights alone. gguf: against bf16 of the same file, so only its int8 activations differ.
# int4 / int4-awq / int4-gptq: 4-bit groups of 32 from the float weights (decisions 066, 067); the
# calibrated modes take the tighter budget.
BUDGET = {QuantMode.BF16: 0.0, QuantMode.INT8: 1.0, QuantMode.FP8: 2.0, QuantMode.GGUF: 1.0,
          QuantMode.INT4: 3.0, QuantMode.INT4_AWQ: 2.0, QuantMode.INT4_GPTQ: 2.0}
KV_BUDGET = 0.5
PEERS = ("f16", "q8_0")  # llama.cpp GGUF types; "file": a GGUF checkpoint as shipped
FILE_GOAL = 0.5  # % perplexity: gguf weights against llama.cpp on the same GGUF file


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


def perplexity(engine, windows: list[list[int]], desc: str = "perplexity", chunk: int = 16,
               reference: list[torch.Tensor] | None = None, out: dict | None = None) -> float:
    """With ``out``: out["logp"] gets each window's log-probs [len - 1, vocab], and with ``reference``
    (such a list from another run) out["kl"] the mean KL divergence reference || this per token, in nats."""
    nll, count, kl, logps = 0.0, 0, 0.0, []
    for i, w in enumerate(tqdm(windows, desc=desc, unit="window", leave=False)):
        logp = torch.log_softmax(chunked_logits(engine, w, chunk=chunk)[:-1].float(), dim=-1)
        nll -= logp.gather(1, torch.tensor(w[1:])[:, None]).sum().item()
        if reference is not None:
            kl += (reference[i].exp() * (reference[i] - logp)).sum().item()
        if out is not None and reference is None:
            logps.append(logp)
        count += len(w) - 1
    if out is not None:
        out.update(logp=logps, kl=kl / count if reference is not None else 0.0)
    return math.exp(nll / count)


def held_out_windows(tok, max_tokens: int, window: int) -> list[list[int]]:
    """The first ``max_tokens`` token ids of the held-out topics, in windows of ``window``."""
    _, held, _ = load_corpus()
    stream = [t for text in held for t in tok.encode(text)][:max_tokens]
    return [stream[i:i + window] for i in range(0, len(stream) - window + 1, window)]


def with_kv(engine, kv: KVDtype):
    """The same loaded (and quantized) weights with another KV page format."""
    cfg = dataclasses.replace(engine.cfg, kv_dtype=kv)
    return dataclasses.replace(engine, cfg=cfg, spec=KVPageSpec.for_model(engine.model_config, cfg.block_size, kv))


def model_path(args) -> Path:
    if args.model:
        return fetch(args.model)
    return args.model_dir


def llamacpp_rows(path: Path, windows: list[list[int]], threads: int, peers: list[str],
                  reference: list | None = None, kl: dict | None = None) -> dict:
    """{type: perplexity or the reason there is none}; ``kl`` gets {type: KL vs ``reference``}."""
    ok, why = llamacpp.status()
    if not ok:
        tqdm.write(f"llama.cpp not installed: {why}")
        return {fmt: "llama.cpp not installed" for fmt in peers}
    out = {}
    for fmt in peers:
        try:
            got: list = []
            out[fmt] = llamacpp.perplexity(llamacpp.gguf_for(path, fmt), windows, threads, desc=f"llama.cpp {fmt}",
                                           reference=reference, kl=got)
            if got and kl is not None:
                kl[fmt] = got[0]
        except Exception as e:  # a peer failure must not lose our own numbers
            out[fmt] = f"failed: {e!r}"
        tqdm.write(f"llama.cpp {fmt}: {out[fmt]}")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="a registered model name (python -m tools.fetch_model --list)")
    src.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="an HF directory or a .gguf")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=1536, help="held-out tokens scored per mode")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=64, help="tokens per step after the 32-token prompt")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch and llama.cpp threads (1: on a shared machine 2 OpenMP threads can be far slower)")
    ap.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp rows")
    ap.add_argument("--weights", default=",".join(w.value for w in WEIGHTS),
                    help="comma list of weight modes (bf16 first: the baseline); gguf for a GGUF model's blocks")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help="llama.cpp types: f16, q8_0, q4_k_m, q4_0, q4_1, file (a GGUF model as shipped)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = model_path(args)
    t0 = time.perf_counter()

    windows = held_out_windows(ModelTokenizer(path), args.max_tokens, args.window)
    prompts = [w[:32] for w in windows[::max(1, len(windows) // args.prompts)][:args.prompts]]

    results, reference, ref_logp = {}, None, None
    weights = [QuantMode(w) for w in args.weights.split(",") if w]
    if weights[0] is not QuantMode.BF16:
        ap.error("--weights must start with bf16 (the baseline the table compares against)")
    bar = tqdm(total=len(weights) * len(KVS), desc="modes", unit="mode")
    for w in weights:
        loaded = load_engine(EngineConfig(model_dir=path, weights=w, kv_dtype=KVS[0]))
        for kv in KVS:
            engine = with_kv(loaded, kv)
            scored: dict = {}
            ppl = perplexity(engine, windows, desc=f"{w.value}/{kv.value}", chunk=args.chunk, reference=ref_logp,
                             out=scored)
            ref_logp = ref_logp if ref_logp is not None else scored["logp"]  # bf16/bf16's: the first row
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
            key = f"{w.value}/{kv.value}"
            results[key] = {"weights": w.value, "kv": kv.value, "perplexity": ppl,
                            "kl_vs_bf16": scored["kl"], "teacher_forced_agreement": agree / total,
                            "mean_identical_prefix": sum(same_prefix) / len(same_prefix)}
            tqdm.write(f"{key}: {results[key]}")
            bar.update()
        del loaded
    bar.close()
    peer_kl: dict = {}
    peers = {} if args.no_llamacpp else llamacpp_rows(path, windows, args.threads, [p for p in args.peers.split(",") if p],
                                                      ref_logp, peer_kl)

    report = {"benchmark": "accuracy", "model": args.model or (path.stem if path.is_file() else path.name),
              "model_path": str(path), "held_out_tokens": len(windows) * args.window, "windows": len(windows),
              "prompts": len(prompts), "generated": args.gen, "chunk": args.chunk, "threads": args.threads,
              "results": results, "llamacpp": peers, "llamacpp_kl_vs_bf16": peer_kl, "wall_s": time.perf_counter() - t0,
              "calibration": CALIBRATION.describe() if {QuantMode.INT4_AWQ, QuantMode.INT4_GPTQ} & set(weights) else None,
              "command": "python -m bench accuracy " + " ".join(argv if argv is not None else [])}
    common.save(report, markdown(report), args.out)
    return report


def _kl(value) -> str:
    return "" if value is None else f"{value:.5f}"


def markdown(report: dict) -> str:
    r = report["results"]
    base = r["bf16/bf16"]["perplexity"]
    lines = [f"Model {report['model']}, {report['held_out_tokens']} held-out tokens (Python documentation topics) "
             f"in {report['windows']} windows (32-token prompt, then {report.get('chunk', 16)}-token steps reading "
             f"the paged KV); greedy agreement over {report['generated']} tokens for "
             f"{report['prompts']} held-out prompts.", "",
             "| weights | KV | perplexity | vs bf16/bf16 | budget | KL vs bf16/bf16 (nats/token) | teacher-forced agreement "
             "| identical prefix (tokens) |", "|---|---|---|---|---|---|---|---|"]
    with_kl = any("kl_vs_bf16" in v for v in r.values())  # results saved before the KL column have none
    for v in r.values():
        w, kv = QuantMode(v["weights"]), KVDtype(v["kv"])
        budget = BUDGET[w] + (KV_BUDGET if kv == KVDtype.FP8_E4M3 else 0.0)
        delta = 100 * (v["perplexity"] / base - 1)
        ok = "within" if delta <= budget + 1e-9 else "MISSED"
        lines.append(f"| {v['weights']} | {v['kv']} | {v['perplexity']:.3f} | {delta:+.2f}% | "
                     f"+{budget:.1f}% ({ok}) | {_kl(v.get('kl_vs_bf16'))} | {v['teacher_forced_agreement']:.3f} | "
                     f"{v['mean_identical_prefix']:.1f} |")
    peer_kl = report.get("llamacpp_kl_vs_bf16") or {}
    for fmt, ppl in report.get("llamacpp", {}).items():
        if isinstance(ppl, float):
            lines.append(f"| llama.cpp {fmt} | f16 | {ppl:.3f} | {100 * (ppl / base - 1):+.2f}% | | {_kl(peer_kl.get(fmt))} | | |")
        else:
            lines.append(f"| llama.cpp {fmt} | | {ppl} | | | | | |")
    shipped = report.get("llamacpp", {}).get("file")
    if isinstance(shipped, float) and "gguf/bf16" in r:
        ours = r["gguf/bf16"]["perplexity"]
        delta = 100 * (ours / shipped - 1)
        lines += ["", f"gguf weights vs llama.cpp on the same file (same token ids): {ours:.3f} vs {shipped:.3f} "
                      f"({delta:+.2f}%; goal within {FILE_GOAL}%: {'met' if abs(delta) <= FILE_GOAL else 'MISSED'})."]
    q4 = report.get("llamacpp", {}).get("q4_k_m")
    for mode in ("int4", "int4-awq", "int4-gptq"):
        if isinstance(q4, float) and f"{mode}/bf16" in r:
            ours = r[f"{mode}/bf16"]["perplexity"]
            lines += ["", f"{mode} weights vs llama.cpp q4_k_m of the same weights (same token ids): {ours:.3f} vs "
                          f"{q4:.3f} ({'at or below' if ours <= q4 + 1e-9 else 'ABOVE'} q4_k_m)."]
    calibrated = [m for m in ("int4-awq", "int4-gptq") if f"{m}/bf16" in r]
    if calibrated:
        lines += ["", f"{' and '.join(calibrated)} calibration text: {report.get('calibration', '')}."]
    q8 = report.get("llamacpp", {}).get("q8_0")
    if isinstance(q8, float) and "int8/bf16" in r:
        ours = r["int8/bf16"]["perplexity"]
        lines += ["", f"int8 weights vs llama.cpp q8_0 (same token ids): {ours:.3f} vs {q8:.3f} "
                      f"({'at or below' if ours <= q8 + 1e-9 else 'ABOVE'} q8_0)."]
    if not with_kl:  # drop the empty column: the table as it was rendered then
        lines = [_without_column(line, 5) if line.startswith("|") else line for line in lines]
    return "\n".join(lines) + "\n"


def _without_column(line: str, index: int) -> str:
    cells = line.split("|")  # "", cell 0, ..., cell n, ""
    return "|".join(cells[:index + 1] + cells[index + 2:])


if __name__ == "__main__":
    main()
