"""One command line for every benchmark.

    python -m bench <name> [options]          # python -m bench <name> --help for a benchmark's options
    python -m bench <name> [options] --save-results   # also copy the run's JSON to docs/results/<machine>/
    python -m bench report [--write]          # README / docs/benchmarks.md tables from docs/results/ (bench/report.py)
    python -m bench all [--write-docs] [--serve-args "..."] [--engine-args "..."] ...

Names: serve (load on the front door), engine (ours against transformers and llama.cpp),
tokenizer (Tokenize RPC and streaming detokenize), kv (KV bytes and overlap on the wire),
accuracy (quantization cost), int4 (4-bit group size, format, RTN against AWQ), disagg (served against in-process, batch 1), and speculative when
bench/speculative.py is present, trace (one request's spans as a waterfall PNG), and prefix
(prefix caching across the split: TTFT hit vs miss, KV bytes on the wire), prefix-routing (prefix
caching over two decode replicas: round_robin against --decode-routing prefix), serve-vs-vllm or serve-peers (our OpenAI
door against vLLM's CPU build and llama.cpp's llama-server at their best configurations, all driven by
`vllm bench serve`, goals per level; vLLM in its own venv), kernels (the
Triton KV kernels against the PyTorch reference on a CUDA device), gguf-kernels (GGUF block matmuls,
Triton W4A16 on a CUDA device or the C kernels on the CPU, against a bf16 matmul), memory (the services' resident
memory against weights + KV pool), capacity (sequences held and output tok/s served at equal KV
memory: bf16 against FP8 pages, bf16 against int8 weights), choices (one request with n choices
against n requests: time and KV pages), lm-eval (lm-evaluation-harness through the OpenAI door
against the same harness on transformers, on a local multiple-choice task), structured (grammar engines and the
step time with a constrained request in the batch). ``all`` runs
tokenizer, kv, serve and engine with their defaults (plus whatever ``--<name>-args`` adds). Every
run writes bench/out/<name>-<model>-<stamp>.json/.md (+ PNG plots); ``--save-results`` also copies
the JSON to docs/results/<machine-slug>/<name>-<model>.json, from which ``python -m bench report
--write`` regenerates the README's headline table and docs/benchmarks.md's latest results.
``--write-docs`` does both: copies the JSON and regenerates the tables.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import shlex
import sys


BENCHMARKS = {"serve": "bench.serve", "engine": "bench.engine", "tokenizer": "bench.tokenizer", "kv": "bench.kv",
              "accuracy": "bench.accuracy", "int4": "bench.int4", "disagg": "bench.disagg", "speculative": "bench.speculative",
              "trace": "bench.trace", "prefix": "bench.prefix", "prefix-routing": "bench.prefix_routing", "serve-vs-vllm": "bench.serve_peers",
              "serve-peers": "bench.serve_peers",
              "kernels": "bench.kernels", "gguf-kernels": "bench.gguf_kernels", "memory": "bench.memory",
              "capacity": "bench.capacity", "choices": "bench.choices", "lm-eval": "bench.lmeval",
              "structured": "bench.structured"}
ALL = ("tokenizer", "kv", "serve", "engine")


def available() -> list[str]:
    return [n for n, m in BENCHMARKS.items() if importlib.util.find_spec(m) is not None]


def run(name: str, argv: list[str], write_docs: bool, save_results: bool = False) -> dict | None:
    mod = importlib.import_module(BENCHMARKS[name])
    if inspect.signature(mod.main).parameters:
        report = mod.main(argv)
    else:  # a main() that reads sys.argv itself
        sys.argv = [f"python -m bench {name}", *argv]
        report = mod.main()
    if (save_results or write_docs) and isinstance(report, dict) and report.get("files", {}).get("json"):
        from bench import report as results
        print(f"[bench] result for docs/results: {results.ingest(report['files']['json'])}", flush=True)
        if write_docs:
            results.main(["--write"])
    return report


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:
        from bench import report
        report.main(argv[1:])
        return
    names = available()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in (*names, "all"):
        print(__doc__ + "\navailable here: " + ", ".join(names + ["all", "report"]))
        sys.exit(0 if not argv or argv[0] in ("-h", "--help") else 2)
    name, rest = argv[0], argv[1:]
    write_docs, save_results = "--write-docs" in rest, "--save-results" in rest
    rest = [a for a in rest if a not in ("--write-docs", "--save-results")]
    if name != "all":
        run(name, rest, write_docs, save_results)
        return
    ap = argparse.ArgumentParser(prog="python -m bench all")
    for n in ALL:
        ap.add_argument(f"--{n}-args", default="", help=f"extra options for {n}, one quoted string")
    args = ap.parse_args(rest)
    failed = []
    for n in ALL:
        print(f"\n[bench] ===== {n} =====", flush=True)
        try:
            run(n, shlex.split(getattr(args, f"{n}_args")), write_docs, save_results)
        except Exception as e:  # one broken benchmark must not lose the others' numbers
            print(f"[bench] {n} failed: {e!r}", flush=True)
            failed.append(n)
    if failed:
        sys.exit(f"[bench] failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
