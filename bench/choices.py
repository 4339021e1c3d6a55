"""n > 1 choices: one request with n choices against n separate requests (the same tokens).

    python -m bench choices [--model-dir PATH] [--prompt-len 512] [--gen 32] [--n 4] [--repeats 3]

Method and details: bench/README.md, section ``bench/choices.py``.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench import common
from kvwire import LLM, SamplingParams
from kvwire.config import DEFAULT_MODEL_DIR, KVDtype, QuantMode


def run(llm: LLM, prompt: list[int], params: list[SamplingParams]) -> tuple[float, int, list[list[int]]]:
    """Every request of ``params`` on ``prompt``, together: (seconds, peak pages used, tokens per choice)."""
    rids = [llm.add_request(prompt, p) for p in params]
    ids = [c for r, p in zip(rids, params) for c in (r, *(f"{r}#{i}" for i in range(1, p.n)))]
    tokens: dict[str, list[int]] = {c: [] for c in ids}
    live, peak = set(ids), 0
    t0 = time.perf_counter()
    while live:
        for out in llm.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                live.discard(out.request_id)
        peak = max(peak, llm.stats()["used"])
    return time.perf_counter() - t0, peak, [tokens[c] for c in ids]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--weights", default="int8", choices=[m.value for m in QuantMode])
    ap.add_argument("--kv-dtype", default="fp8_e4m3", choices=[d.value for d in KVDtype])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=32, help="tokens generated per choice")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="best of, each way")
    ap.add_argument("--out", type=Path, default=common.OUT)
    args = ap.parse_args(argv)
    pages = args.n * -(-(args.prompt_len + args.gen) // 16) + 16
    llm = LLM(args.model_dir, weights=args.weights, kv_dtype=args.kv_dtype, num_pages=pages)
    vocab = llm.runtime.model_config.vocab_size
    prompt = [(i * 7919) % (vocab - 10) + 10 for i in range(args.prompt_len)]  # ids clear of the special ones
    sampled = dict(max_tokens=args.gen, ignore_eos=True, temperature=1.0, seed=1)
    one = [SamplingParams(**sampled, n=args.n)]
    apart = [SamplingParams(**{**sampled, "seed": 1 + i}) for i in range(args.n)]  # choice i's seed stream
    run(llm, prompt[:32], apart)  # warm-up
    rows = {"n_choices": [], "separate": []}
    for _ in range(args.repeats):  # interleaved: the machine's load hits both alike
        rows["n_choices"].append(run(llm, prompt, one))
        rows["separate"].append(run(llm, prompt, apart))
    same = rows["n_choices"][0][2] == rows["separate"][0][2]
    report = {"benchmark": "choices", "model": args.model_dir.name, "weights": args.weights,
              "kv_dtype": args.kv_dtype, "prompt_len": args.prompt_len, "gen": args.gen, "n": args.n,
              "repeats": args.repeats, "same_tokens": same,
              **{k: {"seconds": min(r[0] for r in v), "peak_pages": max(r[1] for r in v)} for k, v in rows.items()}}
    common.save(report, markdown(report), args.out)
    return report


def markdown(r: dict) -> str:
    a, b = r["n_choices"], r["separate"]
    rows = [[f"one request, n={r['n']}", common.fmt(a["seconds"], 2), a["peak_pages"]],
            [f"{r['n']} requests, n=1", common.fmt(b["seconds"], 2), b["peak_pages"]]]
    return (f"Model {r['model']} (weights {r['weights']}, KV {r['kv_dtype']}), in process: a {r['prompt_len']}-token "
            f"prompt, {r['gen']} sampled tokens per choice, choice i seeded as request i (the same tokens: "
            f"{r['same_tokens']}); best of {r['repeats']} each way, interleaved.\n\n"
            + common.table(["run", "seconds", "peak KV pages"], rows)
            + f"\n\nn choices: {common.ratio(b['seconds'], a['seconds'])} faster, "
            f"{a['peak_pages'] / b['peak_pages']:.2f}x the pages.\n")


if __name__ == "__main__":
    main()
