"""bench/capacity.py: pages per MiB budget from the real KVPageSpec, the capacity arithmetic, the
goal checks and the report; and one tiny real run (prefill_svc + decode_svc processes, the tiny model)."""
from __future__ import annotations

import json

import pytest

from bench import __main__ as cli
from bench import capacity as cap
from bench import report as results
from kvwire.config import ModelConfig

MIB = 1 << 20


def smollm2(**kw) -> ModelConfig:
    """SmolLM2-135M's shape (30 layers, 3 KV heads of 64): what the default run serves."""
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192, **kw)


def test_page_bytes_and_pages_for_a_budget_per_dtype():
    cfg = smollm2()
    fp8, bf16 = cap.page_spec(cfg, "fp8_e4m3"), cap.page_spec(cfg, "bf16")
    # 16 tokens x 3 heads x 64 dims, K and V, 30 layers; FP8 adds a bf16 scale per (token, head) for K and V.
    assert cap.page_bytes(fp8) == 30 * 2 * (16 * 3 * 64 * 1 + 16 * 3 * 2) == 190_080
    assert cap.page_bytes(bf16) == 30 * 2 * (16 * 3 * 64 * 2) == 368_640
    assert cap.pages_for_budget(64, fp8) == 353 and cap.pages_for_budget(64, bf16) == 182  # floor: whole pages
    assert 353 * 190_080 <= 64 * MIB < 354 * 190_080 and 182 * 368_640 <= 64 * MIB < 183 * 368_640
    assert cap.pages_for_budget(0.1, bf16) == 0


def test_pages_per_sequence_is_the_engines_reservation():
    cfg, spec = smollm2(), cap.page_spec(smollm2(), "bf16")
    assert cap.pages_per_sequence(cfg, spec, 960, 64) == 64
    assert cap.pages_per_sequence(cfg, spec, 961, 64) == 65  # a partly filled page is a whole page
    assert cap.pages_per_sequence(cfg, cap.page_spec(cfg, "bf16", block_size=32), 960, 64) == 32
    windowed = smollm2(layer_windows=(256,) * 30)  # a sliding window caps what one sequence holds
    assert cap.pages_per_sequence(windowed, cap.page_spec(windowed, "bf16"), 960, 64) == 60  # its prompt's pages


def test_plan_at_64_mib():
    rows = cap.plan(smollm2(), cap.parse_modes(cap.DEFAULT_MODES), 64, 960, 64)
    got = {r["mode"]: (r["pool_pages"], r["pages_per_sequence"], r["computed"]) for r in rows}
    assert got == {"bf16/bf16": (182, 64, 2), "bf16/fp8_e4m3": (353, 64, 5), "int8/fp8_e4m3": (353, 64, 5)}
    assert all(r["pool_mb"] <= 64 for r in rows) and rows[0]["pool_mb"] == pytest.approx(182 * 368_640 / MIB)
    assert cap.computed_capacity(127, 64) == 1 and cap.computed_capacity(128, 64) == 2


def test_parse_modes_and_levels():
    assert cap.parse_modes("bf16/bf16, int8/fp8,int8/fp8_e4m3") == [("bf16", "bf16"), ("int8", "fp8_e4m3")]
    for bad in ("int3/fp8", "bf16", "bf16/int8", ""):
        with pytest.raises(ValueError):
            cap.parse_modes(bad)
    assert cap.default_sweep(5) == [1, 2, 4, 5] and cap.default_sweep(4) == [1, 2, 4] and cap.default_sweep(1) == [1]
    assert cap.sweep_levels([1, 3, 8], 5) == [1, 3, 5] and cap.sweep_levels([], 2) == [2]


def level(c: int, tok_s: float) -> dict:
    return {"concurrency": c, "requests": 2 * c, "completed": 2 * c, "failed": 0, "output_throughput": tok_s,
            "decode_tok_s": 10.0 * c, "tpot_ms": {"p50": 50.0, "mean": 50.0}, "peak_running": c}


def mode(name: str, computed: int, observed: int | None, levels: list[dict]) -> dict:
    weights, kv = name.split("/")
    row = {"mode": name, "weights": weights, "kv_dtype": kv, "page_bytes": 1, "pool_pages": 10 * computed,
           "pool_mb": 1.0, "pages_per_sequence": 10, "computed": computed, "levels": levels}
    if observed is not None:
        row["observed"] = observed
    return row


def test_goals_use_what_the_server_held_and_the_throughput_at_that_load():
    rows = [mode("bf16/bf16", 2, 2, [level(1, 10.0), level(2, 15.0)]),
            mode("bf16/fp8_e4m3", 5, 4, [level(1, 11.0), level(4, 30.0)]),
            # a level above what was held (not driven by the bench, but here to prove it is not taken)
            mode("int8/fp8_e4m3", 5, 4, [level(1, 12.0), level(4, 29.0), level(5, 99.0)])]
    seqs, tput = cap.goals(rows)
    assert seqs["measured"] == 2.0 and seqs["met"] is True and "bf16/fp8_e4m3 held 4" in seqs["detail"]
    assert tput["measured"] == pytest.approx(29.0 / 15.0) and tput["met"] is False
    assert cap.verdict(seqs) == "met" and cap.verdict(tput) == "NOT met"
    rows[1]["observed"] = 3  # 3 / 2 < 1.9: the computed 5 must not rescue it
    rows[2]["levels"][1]["output_throughput"] = 30.0  # exactly 2x
    seqs, tput = cap.goals(rows)
    assert seqs["met"] is False and tput["met"] is True


def test_goals_without_measurements_are_not_measured():
    rows = [mode("bf16/bf16", 2, None, []), mode("int8/fp8_e4m3", 5, None, [])]
    rows[0]["error"] = "RuntimeError('boom')"
    seqs, tput = cap.goals(rows)  # no same-weights pair: any FP8 mode against any bf16 one
    assert seqs["met"] is None and tput["met"] is None and cap.verdict(tput) == "not measured"
    (only_bf16,) = cap.goals([mode("bf16/bf16", 2, 2, [level(2, 1.0)])])[:1]
    assert only_bf16["met"] is None and "needs" in only_bf16["detail"]


def test_markdown_and_report_registration(tmp_path):
    rows = [mode("bf16/bf16", 2, 2, [level(1, 10.0), level(2, 15.0)]), mode("int8/fp8_e4m3", 5, 5, [level(5, 40.0)])]
    rows.append({**mode("bf16/fp8_e4m3", 5, None, []), "error": "RuntimeError('stack did not start')"})
    report = {"benchmark": "capacity", "model": "m", "budget_mb": 64.0, "block_size": 16, "prompt_len": 960,
              "output_len": 64, "waves": 3, "probe_factor": 2, "modes": rows, "goals": cap.goals(rows),
              "machine": {"cpu": "AMD EPYC", "cores": 2, "torch_threads": 2, "memory_gib": 23.5, "isa": ["avx2"],
                          "torch": "2", "load_avg_1m": 0.1}, "date": "2026-12-05",
              "command": "python -m bench capacity"}
    md = cap.markdown(report)
    assert "| int8/fp8_e4m3 | 50 | 1.00 |" in md and "| 40.0 | 50.0 | 50.0 | 5: 40.0 |" in md
    assert "1: 10.0, 2: 15.0" in md and "error: RuntimeError('stack did not start')" in md
    assert "**met** | bf16/fp8_e4m3 held None" not in md and "2.67x | 2x | **met**" in md  # 40 / 15
    assert cli.BENCHMARKS["capacity"] == "bench.capacity" and results.MODULES["capacity"] == "bench.capacity"
    src = tmp_path / "capacity-m-20261205-000000.json"
    src.write_text(json.dumps(report))
    dest = results.ingest(src, root=tmp_path / "results")
    assert dest.name == "capacity-m.json" and "Model m" in results.latest(results.load(tmp_path / "results"))
    assert [p.name for p in cap.plot(report, tmp_path, "capacity-m")] == ["capacity-m-throughput.png"]


def test_tiny_run_end_to_end(tiny_dir, tmp_path):
    """Real processes: the pool the server reports matches the plan; the computed number of full-length
    sequences runs at once with no preemption; the probe past it makes the server preempt or queue;
    every level completes."""
    report = cli.run("capacity", ["--model", str(tiny_dir), "--modes", "bf16/bf16,int8/fp8", "--budget-mb", "0.1",
                                  "--prompt-len", "40", "--output-len", "80", "--waves", "1", "--sweep", "1",
                                  "--probe-factor", "1", "--stats-interval-s", "0.005", "--out", str(tmp_path)],
                     write_docs=False)
    rows = {r["mode"]: r for r in report["modes"]}
    assert not [r["error"] for r in rows.values() if r.get("error")]
    for r in rows.values():
        assert r["server"]["total_pages"] == r["pool_pages"] and r["server"]["page_bytes"] == r["page_bytes"]
        assert r["probe"]["requests"] == r["computed"] + 2 and r["probe"]["completed"] == r["computed"] + 2
        assert r["fit"]["preemptions"] == 0 and r["observed"] == r["fit"]["peak_running"] == r["computed"]
        assert r["probe"]["preemptions"] > 0 or r["probe"]["peak_waiting"] >= 1
        assert [lv["concurrency"] for lv in r["levels"]] == sorted({1, r["observed"]})
        assert all(lv["completed"] == lv["requests"] and lv["output_tokens"] == 80 * lv["requests"]
                   for lv in r["levels"])
    assert rows["bf16/bf16"]["computed"] < rows["int8/fp8_e4m3"]["computed"]
    assert [g["met"] is not None for g in report["goals"]] == [True, True]
    assert len(list(tmp_path.glob("capacity-*.png"))) == 1 and len(list(tmp_path.glob("capacity-*.json"))) == 1


def test_the_held_count_is_what_the_server_ran_not_the_arithmetic(tiny_dir, tmp_path):
    """decode_svc capped below what the pool holds: the bench reports and drives the server's 2, not its 5."""
    report = cli.run("capacity", ["--model", str(tiny_dir), "--modes", "int8/fp8", "--budget-mb", "0.1",
                                  "--prompt-len", "40", "--output-len", "80", "--waves", "1", "--sweep", "none",
                                  "--max-running", "2", "--stats-interval-s", "0.005", "--out", str(tmp_path)],
                     write_docs=False)
    (r,) = report["modes"]
    assert r["computed"] == 5 and r["observed"] == 2 and r["fit"]["peak_waiting"] >= 1
    assert [lv["concurrency"] for lv in r["levels"]] == [2] and cap.at_capacity(r) is r["levels"][0]
