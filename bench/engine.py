"""Engine benchmark: ours (weight x KV modes) against transformers and llama.cpp on the same weights
and token ids: prefill, batch-1 and batched decode tokens/s, peak memory.

    python -m bench engine --model smollm2-135m [--weights none,bf16,int8,fp8] [--kv fp8_e4m3,bf16] \
        [--peers transformers-fp32,transformers-bf16,llama.cpp-f16,llama.cpp-q8_0,llama.cpp-file] \
        [--prompt-len 512] [--decode-tokens 32] [--batches 1,4,16] [--batch-ctx 128]

Method and details: bench/README.md, section ``bench/engine.py``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

from bench import common, llamacpp, machine, plots, shapes
from bench.engine_runs import run_spec
from kvwire.model.registry import resolve_model_path

PEERS = {"transformers-fp32": ("transformers", "none"), "transformers-bf16": ("transformers", "bf16"),
         "llama.cpp-f16": ("llama.cpp", "f16"), "llama.cpp-q8_0": ("llama.cpp", "q8_0"),
         "llama.cpp-q4_k_m": ("llama.cpp", "q4_k_m"),
         "llama.cpp-file": ("llama.cpp", "file")}  # file: a GGUF --model-dir as shipped (its own types)
DEFAULT_PEERS = ("transformers-fp32", "transformers-bf16", "llama.cpp-f16", "llama.cpp-q8_0")


def run_one(spec: dict, timeout_s: float, in_process: bool = False) -> dict:
    if in_process:  # quick runs (smoke test): no isolation, so peak RSS is this whole process's
        return run_spec(spec)
    proc = subprocess.run([sys.executable, "-m", "bench.engine_runs", json.dumps(spec)], cwd=common.ROOT,
                          stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout_s)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        return {"error": f"exit code {proc.returncode}: {proc.stdout[-300:]}"}
    return json.loads(line.removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(shapes.SHAPES))
    ap.add_argument("--model-dir", type=Path, help="an HF Llama directory, a GGUF or a registered model name "
                                                  "(smollm2-135m-instruct) instead of a --model shape")
    ap.add_argument("--models-dir", type=Path, default=common.MODELS)
    ap.add_argument("--weights", default="none,bf16,int8,fp8")
    ap.add_argument("--kv", default="fp8_e4m3,bf16")
    ap.add_argument("--eager", default="", help="weight modes to run again with the fused CPU decode kernels off "
                                                "(KVWIRE_CPU_KERNELS=0: eager PyTorch ops), e.g. int8,bf16")
    ap.add_argument("--peers", default=",".join(DEFAULT_PEERS), help="comma list of " + ", ".join(PEERS) + " (empty: none)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--batch-ctx", type=int, default=128, help="context of each sequence in batched decode")
    ap.add_argument("--threads", type=int, default=0, help="torch / llama.cpp threads (0: torch's default)")
    ap.add_argument("--device", default="cpu", help="torch device for kvwire and transformers: cpu, or cuda[:N] "
                                                    "(llama.cpp peers stay on the CPU: they are not run then)")
    ap.add_argument("--in-process", action="store_true",
                    help="run every configuration in this process (quick; peak RSS is then not per engine)")
    ap.add_argument("--timeout-s", type=float, default=1800, help="per configuration")
    ap.add_argument("--out", type=Path, default=common.OUT)
    args = ap.parse_args(argv)

    model_dir = resolve_model_path(args.model_dir) if args.model_dir else shapes.build(args.model, args.models_dir)
    facts = machine.facts(device=args.device)
    base = {"model_dir": str(model_dir), "device": args.device, "prompt_len": args.prompt_len,
            "decode_tokens": args.decode_tokens,
            "batches": [int(b) for b in args.batches.split(",")], "batch_ctx": args.batch_ctx,
            "threads": args.threads or facts["torch_threads"], "isolated": not args.in_process}
    configs = [(f"kvwire {w}/{kv}", {"engine": "kvwire", "weights": w, "kv": kv})
               for w in filter(None, args.weights.split(",")) for kv in filter(None, args.kv.split(","))]
    configs += [(f"kvwire eager {w}/{kv}", {"engine": "kvwire", "weights": w, "kv": kv, "fused": False})
                for w in filter(None, args.eager.split(",")) for kv in [w_kv for w_kv in args.kv.split(",") if w_kv][:1]]
    llama_ok, llama_status = llamacpp.status()
    for peer in filter(None, args.peers.split(",")):
        engine, w = PEERS[peer]
        if engine != "llama.cpp" or (llama_ok and args.device == "cpu"):
            configs.append((peer, {"engine": engine, "weights": w}))
    results = []
    for name, spec in tqdm(configs, desc="engine configurations", unit="run"):
        tqdm.write(f"-- {name}")
        try:
            res = run_one({**base, **spec}, args.timeout_s, args.in_process)
        except subprocess.TimeoutExpired:
            res = {"error": f"timed out after {args.timeout_s:.0f} s"}
        if spec["engine"] == "llama.cpp" and res.get("error", "").startswith("exit code -11"):
            # llama.cpp's repacked weight buffers (its AMX-INT8 q8_0 path, llama-cpp-python 0.3.36)
            # crash with more than one token per batch on some CPUs: run it again on its plain kernels.
            tqdm.write(f"{name} crashed (SIGSEGV); again without llama.cpp's extra weight buffers")
            res = run_one({**base, **spec, "extra_bufts": False}, args.timeout_s, args.in_process)
            res["note"] = "crashed with llama.cpp's repacked (AMX) weight buffers; run without them"
        res = {**spec, **res, "engine": name, "kind": spec["engine"]}
        if "decode_tok_s" in res:
            roof = machine.roofline_gbs(facts) * 1e9 / res["weight_bytes_per_token"]
            res |= {"roofline_tok_s": roof, "roofline_pct": 100 * res["decode_tok_s"] / roof}
        results.append(res)
        tqdm.write(json.dumps({k: v for k, v in res.items() if k != "model_dir"}))
    report = {"benchmark": "engine", "model": args.model_dir.name if args.model_dir else args.model, **base,
              "machine": facts, "llama_cpp": llama_status if llama_ok else f"not run: {llama_status}",
              "results": results}
    common.save(report, markdown(report), args.out, plots.engine)
    return report


def markdown(report: dict) -> str:
    f, rows = common.fmt, report["results"]
    bs = [str(b) for b in report["batches"]]
    gpu = report.get("device", "cpu") != "cpu"
    lines = [f"Model {report['model']}, same weights and token ids for every engine; prompt {report['prompt_len']} "
             f"tokens, {report['decode_tokens']} greedy decode steps; batched decode: b sequences of "
             f"{report['batch_ctx']} tokens stepped together; {report['threads']} threads"
             f"{', on ' + report['device'] if gpu else ''}. Each row is one process; "
             f"peak RSS includes the {f(min((r.get('baseline_rss_mb') or 1e9) for r in rows), 0)} MB or so of imports"
             f"{' (peak GPU memory: torch allocator peak)' if gpu else ''}. "
             f"llama.cpp: {report['llama_cpp']}.", machine.describe(report["machine"]), ""]
    body = []
    for r in rows:
        if r.get("error"):
            body.append([r["engine"], f"error: {r['error'][:80]}"] + ["-"] * (5 + gpu + len(bs)))
            continue
        bt = r.get("batched_tok_s", {})
        body.append([r["engine"], f(r["prefill_tok_s"]), f(r["decode_tok_s"], 2)] + [f(bt.get(b), 1) for b in bs]
                    + [f(r["peak_rss_mb"], 0)] + ([f(r.get("peak_gpu_mb"), 0)] if gpu else [])
                    + [f(r["weight_bytes_per_token"] / 1e6, 0), f"{r['roofline_pct']:.0f}%"])
    lines.append(common.table(["engine", "prefill tok/s", "decode tok/s (batch 1, after the prompt)"]
                              + [f"batch {b} tok/s (ctx {report['batch_ctx']})" for b in bs]
                              + ["peak RSS MB"] + (["peak GPU MB"] if gpu else [])
                              + ["weight MB/token", "% of roofline"], body))
    lines += [f"\n{r['engine']}: {r['note']}." for r in rows if r.get("note")]
    ours = [r for r in rows if r["engine"].startswith("kvwire") and not r.get("error")]
    peers = [r for r in rows if not r["engine"].startswith("kvwire") and not r.get("error")]
    if ours and peers:
        for key, label in (("decode_tok_s", "batch-1 decode"), ("prefill_tok_s", "prefill"),
                           (f"batch {bs[-1]}", f"batch-{bs[-1]} decode")):
            get = (lambda r: r["batched_tok_s"].get(bs[-1])) if key.startswith("batch ") else (lambda r, k=key: r[k])
            lines += ["", f"Ratio ours/peer, {label} tokens/s:", "",
                      common.table(["ours \\ peer"] + [p["engine"] for p in peers],
                                   [[o["engine"]] + [common.ratio(get(o), get(p)) for p in peers] for o in ours])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
