"""Every benchmark end to end in a tiny configuration (seconds, not a measurement: no speed is
asserted). One stack of real service processes over a tiny model + tokenizer serves the serve,
tokenizer and kv runs (through their ``--addr`` options); engine builds the ``tiny`` shape in tmp.

    python -m pytest -q tests/bench
"""
from __future__ import annotations

import json

import pytest

from bench import __main__ as cli
from tools.stack import Stack


@pytest.fixture(scope="module")
def stack(tiny_dir):
    with Stack(model_dir=tiny_dir, decode_pages=256, prefill_pages=128,
               extra={"decode_svc": ["--draft-model-dir", ""]}) as s:  # not the embedded model's draft
        yield s


def outputs(out, name):
    files = {p.suffix: p for p in out.glob(f"{name}-*")}
    report = json.loads(files[".json"].read_text())
    assert report["benchmark"] == name and files[".md"].read_text().startswith(("Front", "Model", "KV", "Token", "Kernels"))
    return report, sorted(p.name for p in out.glob("*.png"))


def test_cli_lists_benchmarks(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(n in out for n in ("serve", "engine", "tokenizer", "kv", "all"))


def test_serve(stack, tiny_dir, tmp_path):
    cli.main(["serve", "--addr", stack.addr("tokenizer_svc"), "--model-dir", str(tiny_dir), "--num-prompts", "4",
              "--concurrency", "1,2", "--input-len", "12", "--output-len", "3", "--dataset", "random",
              "--out", str(tmp_path)])
    report, pngs = outputs(tmp_path, "serve")
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    assert all(lv["completed"] == 4 and lv["output_tokens"] == 12 for lv in report["levels"])
    assert report["machine"]["memory_bandwidth_gbs"] > 0
    assert len(pngs) == 2


def test_tokenizer(stack, tiny_dir, tmp_path):
    cli.main(["tokenizer", "--addr", stack.addr("tokenizer_svc"), "--model-dir", str(tiny_dir),
              "--num-texts", "8", "--detok-tokens", "64", "--concurrency", "4", "--out", str(tmp_path)])
    report, _ = outputs(tmp_path, "tokenizer")
    assert set(report["rpc"]) == {"1", "4"} and report["detokenize"]["tokens"] == 64
    assert report["detokenize"]["same_text"]


def test_kv(stack, tiny_dir, tmp_path):
    cli.main(["kv", "--addr", stack.addr("prefill_svc"), "--model-dir", str(tiny_dir), "--kv", stack.kv_dtype,
              "--prompt-lens", "20", "--repeats", "1", "--out", str(tmp_path)])
    report, pngs = outputs(tmp_path, "kv")
    (row,) = report["rows"]
    assert row["bytes_per_token"] > 0 and len(row["layer_arrival_ms"]) == row["layers"] == 2
    assert len(pngs) == 1


def test_engine(tmp_path):
    cli.main(["engine", "--model", "tiny", "--models-dir", str(tmp_path / "models"), "--weights", "none",
              "--kv", "fp8_e4m3", "--peers", "transformers-fp32,llama.cpp-f16", "--prompt-len", "16",
              "--decode-tokens", "2", "--batches", "1,2", "--batch-ctx", "8", "--threads", "1", "--in-process",
              "--out", str(tmp_path)])
    report, pngs = outputs(tmp_path, "engine")
    rows = {r["engine"]: r for r in report["results"]}
    assert not any(r.get("error") for r in rows.values()), rows
    assert set(rows["kvwire none/fp8_e4m3"]["batched_tok_s"]) == {"1", "2"}
    assert rows["kvwire none/fp8_e4m3"]["peak_rss_mb"] > 0 and "transformers-fp32" in rows
    assert rows["kvwire none/fp8_e4m3"]["weight_bytes_per_token"] == rows["transformers-fp32"]["weight_bytes_per_token"]
    assert ("llama.cpp-f16" in rows) == report["llama_cpp"].startswith("llama-cpp-python")
    assert len(pngs) == 1


def test_disagg(tmp_path):
    """Its own stack (the embedded model): one prompt length, then 3 prompts at once both ways."""
    cli.main(["disagg", "--prompt-lens", "16", "--gen", "4", "--repeats", "1", "--kv", "fp8_e4m3",
              "--concurrency", "3", "--concurrent-prompt-len", "16", "--out", str(tmp_path)])
    report, _ = outputs(tmp_path, "disagg")
    (row,) = report["rows"]
    assert row["prompt_tokens"] == 16 and row["served"]["ttft_ms"] > 0 and row["kv_bytes"] > 0
    assert row["served_default"]["ttft_ms"] > 0 and row["served_local_prefill"]["ttft_ms"] > 0
    (c,) = report["concurrent"]
    assert c["requests"] == 3 and c["served_tok_s"] > 0 and c["in_process_tok_s"] > 0
    assert "3 different 16-token prompts at once" in (next(tmp_path.glob("disagg-*.md"))).read_text()


def test_kernels_on_the_cpu(tmp_path):
    """bench kernels without a GPU: the C kernels against the reference, one small case per dtype."""
    cli.main(["kernels", "--device", "cpu", "--batches", "2", "--contexts", "40", "--layouts", "smollm2-135m",
              "--prompts", "20,40", "--out", str(tmp_path)])
    report, _ = outputs(tmp_path, "kernels")
    assert report["kernel"] == "kvwire_kernels/cpu (C)" and len(report["attention"]) == 2
    assert all(r["kernel_ms"] > 0 and r["reference_ms"] > 0 for r in report["attention"] + report["writes"])
    assert [p["tokens"] for p in report["prefill"]] == [20, 40]
    assert all(p["kernel_ms"] > 0 and p["sdpa_ms"] > 0 for p in report["prefill"])
    text = next(tmp_path.glob("kernels-*.md")).read_text()
    assert "kernel speedup" in text and "Prefill attention" in text


def test_gguf_kernels_on_the_cpu(tmp_path):
    """bench gguf-kernels without a GPU: the C GGUF kernel against a bf16 matmul; shapes a type's
    blocks do not divide (576 inputs, K types' 256) are left out."""
    cli.main(["gguf-kernels", "--device", "cpu", "--model", "smollm2-135m", "--types", "Q4_0,Q4_K", "--rows", "1,3",
              "--layers", "o", "--out", str(tmp_path)])
    report, _ = outputs(tmp_path, "gguf-kernels")
    assert [(c["type"], c["rows"]) for c in report["cases"]] == [("Q4_0", 1), ("Q4_0", 3)]
    assert all(c["kernel_ms"] > 0 and c["bf16_ms"] > 0 and c["max_rel_err"] < 0.05 for c in report["cases"])
    assert "kernel speedup" in next(tmp_path.glob("gguf-kernels-*.md")).read_text()


def test_memory(tmp_path):
    """prefill_svc and decode_svc of a random tiny shape (no tokenizer: no tokenizer service), both
    KV sources, then each one's resident memory against the weights and its pool."""
    cli.main(["memory", "--shape", "tiny", "--models-dir", str(tmp_path / "models"), "--weights", "int8",
              "--requests", "2", "--prompt-len", "24", "--out", str(tmp_path)])
    report, _ = outputs(tmp_path, "memory")
    rows = {r["process"]: r for r in report["rows"]}
    assert set(rows) == {"decode_svc", "prefill_svc"}
    for r in rows.values():
        assert 0 < r["weights_mb"] < 1 and r["pool_mb"] > 0 and r["peak_mb"] >= r["rss_mb"] > 50
        assert abs(r["runtime_mb"] - (r["peak_mb"] - r["weights_mb"] - r["pool_mb"])) < 0.2
        assert r["peak_over_weights_and_pool"] > 1  # a tiny model: the runtime is most of it
    assert rows["decode_svc"]["pool_mb"] > rows["prefill_svc"]["pool_mb"]  # 2,048 pages against 1,024


def test_choices(tiny_dir, tmp_path):
    cli.main(["choices", "--model-dir", str(tiny_dir), "--weights", "none", "--prompt-len", "40",
              "--gen", "4", "--n", "3", "--repeats", "1", "--out", str(tmp_path)])
    report, _ = outputs(tmp_path, "choices")
    assert report["same_tokens"]
    # 40 + 4 tokens: 3 pages a sequence, the first 2 shared by the choices
    assert (report["n_choices"]["peak_pages"], report["separate"]["peak_pages"]) == (2 + 3, 9)
