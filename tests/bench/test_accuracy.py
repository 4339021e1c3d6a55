"""bench accuracy end to end on a tiny model, and llama.cpp's perplexity against ours (the oracle
for bench/llamacpp.py's GGUF conversion and scoring; skipped where llama-cpp-python is absent)."""
from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from bench import __main__ as cli
from bench import accuracy, llamacpp
from kvwire.kv.dense import DenseKVCache
from kvwire.model.loader import load_model


def test_accuracy_smoke(tiny_dir, tmp_path):
    cli.main(["accuracy", "--model-dir", str(tiny_dir), "--window", "48", "--max-tokens", "96", "--prompts", "1",
              "--gen", "4", "--no-llamacpp", "--out", str(tmp_path)])
    report = json.loads(next(tmp_path.glob("accuracy-*.json")).read_text())
    assert set(report["results"]) == {f"{w}/{kv}" for w in ("bf16", "int8", "fp8") for kv in ("bf16", "fp8_e4m3")}
    for r in report["results"].values():
        assert math.isfinite(r["perplexity"]) and 0 <= r["teacher_forced_agreement"] <= 1
    assert report["results"]["bf16/bf16"]["teacher_forced_agreement"] > 0.7  # its own greedy tokens
    md = next(tmp_path.glob("accuracy-*.md")).read_text()
    assert md.startswith("Model") and md.count("| int8 |") == 2


def test_markdown_places_llamacpp_rows_and_the_q8_0_verdict():
    row = {"teacher_forced_agreement": 1.0, "mean_identical_prefix": 4.0}
    report = {"model": "m", "held_out_tokens": 512, "windows": 2, "prompts": 1, "generated": 4,
              "results": {"bf16/bf16": {"weights": "bf16", "kv": "bf16", "perplexity": 10.0, **row},
                          "int8/bf16": {"weights": "int8", "kv": "bf16", "perplexity": 10.2, **row}},
              "llamacpp": {"f16": 10.01, "q8_0": 10.1}}
    md = accuracy.markdown(report)
    assert "| int8 | bf16 | 10.200 | +2.00% | +1.0% (MISSED)" in md
    assert "| llama.cpp q8_0 | f16 | 10.100 | +1.00% |" in md and "ABOVE q8_0" in md
    report["llamacpp"] = {"f16": "llama.cpp not installed", "q8_0": "llama.cpp not installed"}
    assert "| llama.cpp q8_0 | | llama.cpp not installed |" in accuracy.markdown(report)


def test_markdown_compares_gguf_weights_with_llamacpp_on_the_same_file():
    row = {"teacher_forced_agreement": 1.0, "mean_identical_prefix": 4.0}
    report = {"model": "m", "held_out_tokens": 512, "windows": 2, "prompts": 1, "generated": 4,
              "results": {"bf16/bf16": {"weights": "bf16", "kv": "bf16", "perplexity": 10.0, **row},
                          "gguf/bf16": {"weights": "gguf", "kv": "bf16", "perplexity": 10.08, **row}},
              "llamacpp": {"file": 10.0}}
    md = accuracy.markdown(report)
    assert "| gguf | bf16 | 10.080 | +0.80% | +1.0% (within)" in md
    assert "10.080 vs 10.000 (+0.80%; goal within 0.5%: MISSED)" in md
    report["llamacpp"] = {"file": 10.04}
    assert "goal within 0.5%: met" in accuracy.markdown(report)


def test_llamacpp_file_is_a_gguf_as_shipped(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="not a GGUF file"):
        llamacpp.gguf_for(tiny_dir, "file")
    shipped = tmp_path / "m.gguf"
    shipped.write_bytes(b"GGUF")
    assert llamacpp.gguf_for(shipped, "file") == shipped


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
def test_llamacpp_perplexity_matches_ours_in_fp32(tiny_dir, tmp_path):
    model = load_model(tiny_dir).model
    g = torch.Generator().manual_seed(0)
    windows = [torch.randint(0, model.cfg.vocab_size, (40,), generator=g).tolist() for _ in range(3)]
    nll, count = 0.0, 0
    for w in windows:
        cache = DenseKVCache(model.cfg, 1, len(w))
        logp = torch.log_softmax(model(torch.tensor(w), cache.prepare([0], [len(w)]), cache)[:-1], -1)
        nll -= logp.gather(1, torch.tensor(w[1:])[:, None]).sum().item()
        count += len(w) - 1
    ours = math.exp(nll / count)
    theirs = llamacpp.perplexity(llamacpp.to_gguf(tiny_dir, tmp_path / "tiny-f16.gguf"), windows, threads=1)
    assert abs(theirs / ours - 1) < 0.01, (ours, theirs)  # f16 weights vs fp32: well under 1%
