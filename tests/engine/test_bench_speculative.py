"""``python -m bench speculative`` runs every mode, batch 1 and batched, with its transformers peer,
on the embedded pair; and n-gram alone on a model without a draft."""
from __future__ import annotations

import shutil

import pytest

from bench import speculative
from kvwire.config import DEFAULT_MODEL_DIR


def test_bench_speculative_every_mode_and_the_peer(tmp_path):
    report = speculative.main(["--prompts", "2", "--max-tokens", "6", "--batches", "1,2", "--out", str(tmp_path)])
    rows = {(r["task"], r["batch"], r["mode"]): r for r in report["results"]}
    assert set(rows) == {(t, b, m) for t in ("grounded", "chat") for b in (1, 2) for m in ("none", "ngram", "draft")}
    for r in report["results"]:
        assert r["decode_tokens"] > 0 and r["identical_to_none"] in (None, True), r
    assert {(p["task"], p["mode"]) for p in report["transformers"]} == \
        {(t, m) for t in ("grounded", "chat") for m in ("none", "ngram", "draft")}
    assert (tmp_path / report["files"]["md"]).is_file()
    # prompt lookup's ceiling, replayed over the batch-1 plain outputs at the measured row prices
    assert set(report["ngram_ceiling"]) == {"grounded", "chat"}
    for c in report["ngram_ceiling"].values():
        assert c["any_match"] > 0 and c["latest"] > 0
    assert "ceiling" in (tmp_path / report["files"]["md"]).read_text()


def test_bench_speculative_ngram_without_a_draft(tmp_path):
    model = shutil.copytree(DEFAULT_MODEL_DIR, tmp_path / "solo")  # no solo-draft beside it
    report = speculative.main(["--model-dir", str(model), "--prompts", "1", "--max-tokens", "5", "--batches", "1",
                               "--tasks", "chat", "--peers", "", "--out", str(tmp_path)])
    assert [r["mode"] for r in report["results"]] == ["none", "ngram"] and report["draft"] is None


def test_bench_speculative_with_a_draft_head(tmp_path):
    """A draft head is benched like a draft model; transformers' assisted generation needs a draft
    model, so the peer runs its plain and prompt-lookup modes only."""
    from tests.engine.test_head_proposer import make_head
    head = make_head(DEFAULT_MODEL_DIR, tmp_path / "head")
    report = speculative.main(["--draft-model-dir", str(head), "--prompts", "1", "--max-tokens", "6",
                               "--batches", "1", "--tasks", "chat", "--out", str(tmp_path)])
    assert [r["mode"] for r in report["results"]] == ["none", "ngram", "draft"]
    assert all(r["identical_to_none"] in (None, True) for r in report["results"])
    assert {p["mode"] for p in report["transformers"]} == {"none", "ngram"}


@pytest.mark.parametrize("seeded", [False, True])
def test_bench_speculative_sampled(tmp_path, seeded):
    """--temperature (--top-p): every mode samples (--seeded: a seed per prompt); outputs are not compared
    with plain, and the greedy-only ceiling and peer are not run."""
    report = speculative.main(["--prompts", "2", "--max-tokens", "8", "--batches", "1", "--tasks", "grounded",
                               "--temperature", "0.8", "--out", str(tmp_path)] + ["--seeded", "--top-p", "0.9"] * seeded)
    assert [r["mode"] for r in report["results"]] == ["none", "ngram", "draft"]
    assert all(r["decode_tokens"] > 0 and r["identical_to_none"] is None for r in report["results"])
    assert report["temperature"] == 0.8 and report["seeded"] is seeded
    assert not report["ngram_ceiling"] and not report["transformers"]
    text = (tmp_path / report["files"]["md"]).read_text()
    assert ("sampled at temperature 0.8, top-p 0.9 (a seed per prompt)" if seeded else
            "sampled at temperature 0.8 (unseeded)") in text
