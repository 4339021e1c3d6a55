"""lm-evaluation-harness as a client of the OpenAI door, scored against the same harness on transformers.

    python -m bench lm-eval                          # the full local task, SmolLM2-135M-Instruct
    python -m bench lm-eval --limit 20               # its first 20 questions
    pip install -e ".[eval]"                         # lm_eval itself (not installed by tools/setup.sh)

Method and details: bench/README.md, section ``bench/lmeval.py``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

from bench import common

TASK_YAML = common.ROOT / "tests" / "data" / "lm_eval" / "kvwire_mcq.yaml"
METRICS = ("acc", "acc_norm")
GOAL_POINTS = 0.5  # |door - transformers| per metric, in points (percent)
WEIGHTS = ("none", "bf16", "int8", "fp8", "gguf")
KVS = ("bf16", "fp8_e4m3")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def task_config(yaml_path: Path = TASK_YAML) -> dict:
    """The task YAML as a dict, its data file made absolute (the YAML names it from the repository root)."""
    import yaml
    cfg = yaml.safe_load(yaml_path.read_text())
    files = cfg["dataset_kwargs"]["data_files"]
    cfg["dataset_kwargs"] = {**cfg["dataset_kwargs"],
                             "data_files": {split: str(common.ROOT / f) for split, f in files.items()}}
    return cfg


def client_tokenizer(gguf_path: Path) -> Path:
    """transformers' own tokenizer of the GGUF file, saved as an HF directory: what lm_eval's
    local-completions counts context tokens with (it must split the text as the door does)."""
    out = common.MODELS / "hf-tokenizer" / gguf_path.stem
    if not (out / "tokenizer.json").is_file():
        import transformers
        tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tok.save_pretrained(str(out))
    return out


def evaluate(model: str, model_args: dict, limit: int | None) -> dict:
    """One lm_eval run: {metric: value, metric_stderr: ..., samples: n, wall_s, per_doc: {doc_id: [...]}}."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task_config()], limit=limit,
                                  batch_size=1, log_samples=True, task_manager=TaskManager(), random_seed=0,
                                  numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    wall = time.perf_counter() - t0
    name = task_config()["task"]
    res = out["results"][name]
    per_doc = {}
    for s in out["samples"][name]:  # filtered_resps: per choice (loglikelihood, is_greedy)
        per_doc[int(s["doc_id"])] = {"loglik": [float(r[0]) for r in s["filtered_resps"]],
                                     "acc": float(s["acc"]), "acc_norm": float(s["acc_norm"])}
    row = {m: float(res[f"{m},none"]) for m in METRICS}
    row.update({f"{m}_stderr": float(res[f"{m}_stderr,none"]) for m in METRICS})
    return {**row, "samples": len(per_doc), "wall_s": wall, "per_doc": per_doc}


def door_run(gguf_path: Path, weights: str, kv_dtype: str, args) -> dict:
    """The three services (tools/stack.py) with the HTTP door; lm_eval's local-completions against it."""
    from tools.stack import Stack, free_port
    port = free_port()
    extra = {"tokenizer_svc": ["--http-listen", f"127.0.0.1:{port}", "--model-name", args.model]}
    with Stack(model_dir=gguf_path, weights=weights, kv_dtype=kv_dtype, extra=extra, log_dir=args.log_dir,
               env={"KVWIRE_DRAIN_DELAY_S": "0"}):
        model_args = {"base_url": f"http://127.0.0.1:{port}/v1/completions", "model": args.model,
                      "tokenizer": str(client_tokenizer(gguf_path)), "tokenizer_backend": "huggingface",
                      "tokenized_requests": False,  # the door takes text prompts; lm_eval decodes its token ids
                      "num_concurrent": args.concurrency, "max_retries": 1, "timeout": 600}
        row = evaluate("local-completions", model_args, args.limit)
    return {**row, "weights": weights, "kv_dtype": kv_dtype,
            "model_args": {k: v for k, v in model_args.items() if k not in ("tokenizer", "base_url")}}


def hf_run(gguf_path: Path, args) -> dict:
    """lm_eval's ``hf`` model: transformers loads the same GGUF file itself (dequantized, float32)."""
    model_args = {"pretrained": str(gguf_path.parent), "gguf_file": gguf_path.name, "dtype": "float32",
                  "device": "cpu"}
    row = evaluate("hf", model_args, args.limit)
    return {**row, "model_args": {"gguf_file": gguf_path.name, "dtype": "float32", "device": "cpu"}}


def compare(door: dict, hf: dict) -> dict:
    """Score differences in points, and per question: the choice log-likelihoods and the picks."""
    docs = sorted(set(door["per_doc"]) & set(hf["per_doc"]))
    diffs = [abs(a - b) for d in docs for a, b in zip(door["per_doc"][d]["loglik"], hf["per_doc"][d]["loglik"])]
    out = {f"{m}_points": 100 * (door[m] - hf[m]) for m in METRICS}
    out.update({f"{m}_questions_differing": sum(door["per_doc"][d][m] != hf["per_doc"][d][m] for d in docs)
                for m in METRICS})
    out.update({"questions_compared": len(docs), "choices_compared": len(diffs),
                "loglik_max_abs_diff": max(diffs, default=math.nan),
                "loglik_mean_abs_diff": sum(diffs) / len(diffs) if diffs else math.nan,
                "goal_points": GOAL_POINTS,
                "goal_met": all(abs(out[f"{m}_points"]) <= GOAL_POINTS for m in METRICS)})
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench lm-eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a registered GGUF model (fetched if needed)")
    ap.add_argument("--limit", type=int, default=None, help="the task's first N questions (default: all)")
    ap.add_argument("--concurrency", type=int, default=4, help="lm_eval's concurrent requests to the door")
    ap.add_argument("--modes", default="none/bf16",
                    help="the services' --weights/--kv-dtype, comma list; the first is held to the goal against "
                         "transformers (none/bf16: the GGUF dequantized to float32, as transformers loads it, and "
                         "bf16 pages), the others are shown beside it (e.g. none/bf16,int8/fp8_e4m3)")
    ap.add_argument("--log-dir", type=Path, default=None, help="service logs (default: discarded)")
    ap.add_argument("--out", type=Path, default=common.OUT)
    args = ap.parse_args(argv)
    os.environ.update(OFFLINE)  # before lm_eval / transformers / datasets read them: nothing goes to a hub
    try:
        import lm_eval
    except ImportError:
        ap.exit(2, 'lm_eval is not installed: pip install -e ".[eval]"\n')
    from kvwire.model.registry import fetch
    from kvwire.model.source import model_source
    gguf_path = model_source(fetch(args.model)).gguf
    if gguf_path is None:
        ap.error(f"{args.model}: not a GGUF model (transformers' side loads the GGUF file itself)")
    modes = [tuple(m.split("/")) for m in args.modes.split(",") if m]
    if not modes or any(len(m) != 2 or m[0] not in WEIGHTS or m[1] not in KVS for m in modes):
        ap.error(f"--modes: weights/kv pairs, weights in {WEIGHTS}, kv in {KVS}")
    t0 = time.perf_counter()
    doors = []
    for weights, kv in modes:
        print(f"[lm-eval] lm_eval local-completions against the door ({weights} weights, {kv} KV) ...", flush=True)
        doors.append(door_run(gguf_path, weights, kv, args))
    print("[lm-eval] lm_eval hf (transformers, the same GGUF, float32) ...", flush=True)
    hf = hf_run(gguf_path, args)
    cfg = task_config()
    with open(cfg["dataset_kwargs"]["data_files"]["test"]) as f:
        total = sum(1 for line in f if line.strip())
    report = {"benchmark": "lm-eval", "model": args.model, "task": cfg["task"], "task_questions": total,
              "limit": args.limit, "lm_eval_version": getattr(lm_eval, "__version__", "?"),
              "concurrency": args.concurrency, "door": doors[0], "hf": hf, "comparison": compare(doors[0], hf),
              "other_modes": [{**d, "comparison": compare(d, hf)} for d in doors[1:]], "wall_s": time.perf_counter() - t0,
              "command": "python -m bench lm-eval " + " ".join(argv if argv is not None else [])}
    # per question and choice: bench/out only (docs/results keeps the summary)
    per_doc = {"door": doors[0].pop("per_doc"), "hf": hf.pop("per_doc"),
               **{f"{m['weights']}/{m['kv_dtype']}": m.pop("per_doc") for m in report["other_modes"]}}
    path = common.save(report, markdown(report), args.out)
    side = path.with_name(f"{path.stem}-per-question.json")
    side.write_text(json.dumps(per_doc))
    report["files"]["per_question"] = str(side)
    return report


def _row(label: str, r: dict) -> list:
    return [label, r["samples"], *(f"{100 * r[m]:.2f} ± {100 * r[f'{m}_stderr']:.2f}" for m in METRICS),
            f"{r['wall_s']:.0f}"]


def _diff_row(label: str, c: dict) -> list:
    def picks(n: int) -> str:
        return f"{n} question{' differs' if n == 1 else 's differ'}"
    return [label, "", *(f"{c[f'{m}_points']:+.2f} ({picks(c[f'{m}_questions_differing'])})" for m in METRICS), ""]


def markdown(report: dict) -> str:
    c, door = report["comparison"], report["door"]
    mode = lambda d: f"weights {d['weights']}, KV {d['kv_dtype']}"  # noqa: E731
    rows = [_row(f"kvwire OpenAI door (`local-completions`, {report['concurrency']} concurrent; {mode(door)})", door),
            _row("transformers (`hf`; the same GGUF file, float32)", report["hf"]),
            _diff_row("difference (door - transformers), points", c)]
    for d in report.get("other_modes", []):
        rows += [_row(f"kvwire OpenAI door ({mode(d)})", d), _diff_row(f"difference ({mode(d)}), points",
                                                                    d["comparison"])]
    head = (f"lm-evaluation-harness {report['lm_eval_version']} on the local multiple-choice task "
            f"`{report['task']}` (tests/data/lm_eval/, {door['samples']} of {report['task_questions']} "
            f"questions, 4 choices each, zero-shot), model {report['model']}. Goal: each score through the door "
            f"({mode(door)}) within {c['goal_points']} points of transformers': "
            f"**{'met' if c['goal_met'] else 'NOT met'}**. Per choice, the log-likelihoods differ by "
            f"{c['loglik_mean_abs_diff']:.2g} on average and {c['loglik_max_abs_diff']:.2g} at most "
            f"({c['choices_compared']} choices).\n")
    return head + "\n" + common.table(["client", "questions", "acc (%)", "acc_norm (%)", "wall s"], rows) + "\n"


if __name__ == "__main__":
    main()
