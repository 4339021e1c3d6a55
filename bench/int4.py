"""4-bit weights: group size, format and round-to-nearest against AWQ scales, by perplexity.

    python -m bench int4                                  # the embedded model
    python -m bench int4 --model-dir PATH --groups 32,64,128 --formats q4_0,q4_1 --methods rtn,awq
    python -m bench int4 --model-dir PATH --speed bf16,int8,int4,int4-awq   # prefill and decode tok/s instead

``--speed``: every mode loaded in one process and timed in turns (round after round, the modes
alternating), so load from other work on the machine falls on all of them alike; medians of
``--rounds``. Prefill: one ``--prompt-len`` prompt to its first token; decode: the ``--decode-tokens``
after it, batch 1, FP8 KV pages.

The block Linears' weights are replaced in place by the values their 4-bit groups dequantize to
(``kvwire.model.int4.fake_quant``: for group 32 exactly what ``--weights int4`` runs on, without its
int8 activations); lm_head and the embeddings stay fp32, so each row isolates the 4-bit weights.
Same held-out windows and scoring as ``python -m bench accuracy``; baseline: the fp32 checkpoint, against
which each row also reports the mean KL divergence of its next-token distributions: finer than perplexity,
whose changes of a fraction of a percent can go either way (rounding errors can lower it by chance).
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench import common
from bench.accuracy import chunked_logits, held_out_windows, model_path
from kvwire.config import DEFAULT_MODEL_DIR, KVDtype, RuntimeConfig, WeightsMode
from kvwire.model import awq, int4
from kvwire.runtime import load_runtime
from kvwire.tokenizer import ModelTokenizer


def block_linears(model) -> dict[str, torch.nn.Module]:
    return {n: model.get_submodule(n) for n in (f"layers.{i}.{k}" for i in range(len(model.layers))
                                                for k in awq.BLOCK_LINEARS)}


@torch.inference_mode()
def score(rt, windows: list[list[int]], chunk: int, reference: list[torch.Tensor] | None, desc: str
          ) -> tuple[float, float, list[torch.Tensor]]:
    """(perplexity, mean KL(reference || this) per token in nats, this row's log-probs per window)."""
    nll, kl, count, out = 0.0, 0.0, 0, []
    for i, w in enumerate(tqdm(windows, desc=desc, unit="window", leave=False)):
        logp = torch.log_softmax(chunked_logits(rt, w, chunk=chunk)[:-1].float(), dim=-1)  # [len - 1, vocab]
        nll -= logp.gather(1, torch.tensor(w[1:])[:, None]).sum().item()
        if reference is not None:
            ref = reference[i]
            kl += (ref.exp() * (ref - logp)).sum().item()
        count += len(w) - 1
        out.append(logp)
    return math.exp(nll / count), kl / count, out


def speed(path: Path, modes: list[str], rounds: int, prompt_len: int, decode: int) -> list[dict]:
    import statistics
    from kvwire.generate import generate
    from kvwire.sampling_params import SamplingParams
    rts = {m: load_runtime(RuntimeConfig(model_dir=path, weights=WeightsMode(m), kv_dtype=KVDtype.FP8_E4M3))
           for m in modes}
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, rts[modes[0]].model_config.vocab_size, (prompt_len,), generator=gen).tolist()
    times: dict[str, dict[str, list[float]]] = {m: {"first": [], "all": []} for m in modes}
    for _ in tqdm(range(rounds), desc="speed rounds", unit="round"):
        for m in modes:
            rt = rts[m]
            for key, n in (("first", 1), ("all", decode + 1)):
                t0 = time.perf_counter()
                generate(rt.model, prompt, SamplingParams(max_tokens=n, ignore_eos=True),
                         cache=rt.new_cache(rt.spec.pages_for(prompt_len + n) + 2))
                times[m][key].append(time.perf_counter() - t0)
    rows = []
    for m in modes:
        first, full = statistics.median(times[m]["first"]), statistics.median(times[m]["all"])
        rows.append({"weights": m, "prefill_tok_s": prompt_len / first, "decode_tok_s": decode / max(1e-9, full - first)})
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench int4", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="a registered model name")
    src.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="an HF directory or a .gguf")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=1536, help="held-out tokens scored per row")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--groups", default="32,64,128", help="input channels per scale")
    ap.add_argument("--formats", default="q4_1,q4_0", help="q4_1 (scale + minimum), q4_0 (scale only)")
    ap.add_argument("--methods", default="rtn,awq-scales,awq-clip,awq",
                    help="rtn; awq-scales (AWQ's scales, then round-to-nearest); awq-clip (scales, then each group's "
                         "range searched); awq (scales, then each group's scale and minimum fitted: --weights int4-awq; "
                         "for q4_0 as awq-clip)")
    ap.add_argument("--samples", default=str(awq.CALIBRATION.samples), help="AWQ calibration windows, comma list")
    ap.add_argument("--speed", default="", help="comma list of weight modes to time instead (see the docstring)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=common.OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path, t0 = model_path(args), time.perf_counter()
    if args.speed:
        rows = speed(path, args.speed.split(","), args.rounds, args.prompt_len, args.decode_tokens)
        report = {"benchmark": "int4-speed", "model": args.model or (path.stem if path.is_file() else path.name),
                  "rows": rows, "threads": args.threads, "rounds": args.rounds, "prompt_len": args.prompt_len,
                  "decode_tokens": args.decode_tokens, "wall_s": time.perf_counter() - t0,
                  "command": "python -m bench int4 " + " ".join(argv if argv is not None else [])}
        base = rows[0]
        md = "\n".join(["| weights | prefill tok/s | vs first | decode tok/s, batch 1 | vs first |", "|---|---|---|---|---|"] + [
            f"| {r['weights']} | {r['prefill_tok_s']:.1f} | {r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x | "
            f"{r['decode_tok_s']:.1f} | {r['decode_tok_s'] / base['decode_tok_s']:.2f}x |" for r in rows]) + "\n"
        common.save(report, md, args.out)
        return report
    tok = ModelTokenizer(path)
    windows = held_out_windows(tok, args.max_tokens, args.window)
    rt = load_runtime(RuntimeConfig(model_dir=path, weights=WeightsMode.NONE, kv_dtype=KVDtype.BF16))
    model, cfg = rt.model, rt.model_config
    model.step_fn = None  # the fp32 layers' own forward: weights are edited in place below
    original = {k: v.clone() for k, v in model.state_dict().items()}
    ppl, _, reference = score(rt, windows, args.chunk, None, "fp32")
    rows = [{"format": "fp32", "group": None, "method": "none", "samples": None, "perplexity": ppl, "kl": 0.0}]
    combos = [(f, int(g), m, int(n) if m.startswith("awq") else None) for f in args.formats.split(",") for g in args.groups.split(",")
              for m in args.methods.split(",") for n in (args.samples.split(",") if m.startswith("awq") else ["0"])]
    for fmt, group, method, samples in tqdm(combos, desc="int4 rows", unit="row"):
        model.load_state_dict(original)
        sym = fmt == "q4_0"
        seconds = None
        clips, fits = {}, {}
        if method.startswith("awq"):
            calib = awq.Calibration(samples=samples)
            found = awq.search(model, cfg, calib.windows(tok.encode), calib.describe(), group=group, symmetric=sym)
            awq.fold(model, cfg, found.scales)
            seconds = found.seconds
            imps = {n: found.importance[n] / found.scales[n] ** 2 for n in found.scales}
            if method == "awq-clip" or (method == "awq" and sym):  # scales, then each group's range searched
                clips = {n: awq.clip_search(lin.weight, imps[n], group, sym) for n, lin in block_linears(model).items()}
            elif method == "awq":  # as --weights int4-awq: scales, then each group's (d, m) fitted
                fits = {n: awq.fit_groups(lin.weight, imps[n], group) for n, lin in block_linears(model).items()}
        with torch.no_grad():
            for n, lin in block_linears(model).items():
                lin.weight.copy_(int4.fake_quant(lin.weight, group, sym, clips.get(n), fits.get(n)))
        ppl, kl, _ = score(rt, windows, args.chunk, reference, f"{fmt}/g{group}/{method}")
        row = {"format": fmt, "group": group, "method": method, "samples": samples, "search_s": seconds,
               "bits_per_weight": 4 + 16 * (2 if fmt == "q4_1" else 1) / group, "perplexity": ppl, "kl": kl}
        rows.append(row)
        tqdm.write(str(row))
    report = {"benchmark": "int4", "model": args.model or (path.stem if path.is_file() else path.name),
              "held_out_tokens": len(windows) * args.window, "rows": rows, "threads": args.threads,
              "calibration": awq.CALIBRATION.describe(), "wall_s": time.perf_counter() - t0,
              "command": "python -m bench int4 " + " ".join(argv if argv is not None else [])}
    common.save(report, markdown(report), args.out)
    return report


def markdown(report: dict) -> str:
    base = report["rows"][0]["perplexity"]
    lines = [f"Model {report['model']}, {report['held_out_tokens']} held-out tokens; block Linears fake-quantized, "
             "lm_head and embeddings fp32.", "",
             "| format | group | method | calibration windows | bits/weight | perplexity | vs fp32 | KL vs fp32 (nats/token) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['format']} | {r['group'] or ''} | {r['method']} | {r['samples'] or ''} | "
                     f"{r.get('bits_per_weight', 32):.3g} | {r['perplexity']:.3f} | {100 * (r['perplexity'] / base - 1):+.2f}% | {r['kl']:.5f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
