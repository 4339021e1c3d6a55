"""lm-evaluation-harness through the OpenAI door against the same harness on transformers (bench/lmeval.py).

The task's data is checked on every run. The comparison itself is opt-in (a few minutes on 2 cores,
lm_eval is not installed by tools/setup.sh): ``pip install -e ".[eval]"`` and
``pytest -m lm_eval tests/bench/test_lmeval.py``; otherwise it is skipped with the reason.
"""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

from bench import lmeval
from kvwire.model import registry

NAME = "smollm2-135m-instruct"
LIMIT = 20  # questions: with 20, within 0.5 points means the same count right


def test_task_data_is_well_formed():
    cfg = yaml.safe_load(lmeval.TASK_YAML.read_text())
    assert (cfg["output_type"], cfg["test_split"], cfg["dataset_path"]) == ("multiple_choice", "test", "json")
    path = lmeval.task_config()["dataset_kwargs"]["data_files"]["test"]
    assert path.startswith(str(lmeval.common.ROOT)) and path.endswith(cfg["dataset_kwargs"]["data_files"]["test"])
    docs = [json.loads(line) for line in open(path)]
    assert len(docs) >= 100
    assert [d["id"] for d in docs] == list(range(len(docs)))
    assert len({d["question"].lower() for d in docs}) == len(docs)
    for d in docs:
        assert len(d["choices"]) == 4 and len({c.lower() for c in d["choices"]}) == 4, d
        assert d["answer"] in range(4) and d["question"].endswith("?"), d
    # no position is the answer often enough for a model that always picks it to look good
    counts = [sum(d["answer"] == i for d in docs) for i in range(4)]
    assert max(counts) <= 0.3 * len(docs), counts


def _run(acc: list[float], acc_norm: list[float], logliks: list[list[float]], **mode) -> dict:
    per_doc = {i: {"loglik": ll, "acc": a, "acc_norm": n} for i, (a, n, ll) in enumerate(zip(acc, acc_norm, logliks))}
    return {"acc": sum(acc) / len(acc), "acc_norm": sum(acc_norm) / len(acc_norm), "acc_stderr": 0.1,
            "acc_norm_stderr": 0.1, "samples": len(acc), "wall_s": 1.0, "per_doc": per_doc, **mode}


def test_compare_counts_points_picks_and_loglik_differences():
    door = _run([1, 1, 0, 0], [1, 0, 0, 0], [[-1.0, -2.0], [-3.0, -1.5], [-2.0, -2.0], [-1.0, -1.0]],
                weights="none", kv_dtype="bf16")
    hf = _run([1, 1, 0, 1], [1, 0, 0, 0], [[-1.0, -2.001], [-3.0, -1.5], [-2.0, -2.0], [-1.0, -1.25]])
    c = lmeval.compare(door, hf)
    assert c["acc_points"] == pytest.approx(-25.0) and c["acc_norm_points"] == 0.0
    assert (c["acc_questions_differing"], c["acc_norm_questions_differing"]) == (1, 0)
    assert c["loglik_max_abs_diff"] == pytest.approx(0.25) and c["choices_compared"] == 8
    assert c["loglik_mean_abs_diff"] == pytest.approx(0.251 / 8)
    assert not c["goal_met"]
    assert lmeval.compare(door, door)["goal_met"]
    report = {"benchmark": "lm-eval", "model": NAME, "task": "kvwire_mcq", "task_questions": 158,
              "lm_eval_version": "0.4.13", "concurrency": 4, "door": door, "hf": hf, "comparison": c,
              "other_modes": [{**door, "weights": "int8", "kv_dtype": "fp8_e4m3", "comparison": c}],
              "command": "python -m bench lm-eval"}
    md = lmeval.markdown(report)
    assert "4 of 158 questions" in md and "**NOT met**" in md
    assert "| 4 | 50.00 ± 10.00 | 25.00 ± 10.00 |" in md and "-25.00 (1 question differs)" in md and "+0.00 (0 questions differ)" in md
    assert "kvwire OpenAI door (weights int8, KV fp8_e4m3)" in md
    from bench import report as results
    acc, norm = results.lm_eval_rows(report)
    assert (acc.ours, acc.ratio, norm.ratio) == ("50.00", "-25.00 points", "+0.00 points")
    assert acc.baseline.startswith("75.00 (") and "weights none / KV bf16" in acc.measure


def _opted_in(config) -> bool:
    return re.search(r"(?<!not )\blm_eval\b", config.getoption("markexpr") or "") is not None


@pytest.mark.lm_eval
@pytest.mark.real_model
def test_door_scores_equal_transformers(request, tmp_path):
    if not _opted_in(request.config):
        pytest.skip("opt-in: pytest -m lm_eval tests/bench/test_lmeval.py")
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip('lm_eval is not installed (pip install -e ".[eval]")')
    if not registry.is_cached(NAME):
        pytest.skip(f"{NAME} is not fetched (python -m tools.fetch_model {NAME})")
    report = lmeval.main(["--limit", str(LIMIT), "--out", str(tmp_path)])
    door, hf, c = report["door"], report["hf"], report["comparison"]
    assert door["samples"] == hf["samples"] == c["questions_compared"] == LIMIT
    assert (door["weights"], door["kv_dtype"]) == ("none", "bf16")
    for m in lmeval.METRICS:
        assert abs(c[f"{m}_points"]) <= lmeval.GOAL_POINTS, (m, door[m], hf[m])
        assert c[f"{m}_questions_differing"] == 0, m
    # each choice's log-likelihood, not only the picks: the door's echoed prompt logprobs are
    # transformers' (measured 2e-5 at most; a context length off by one token would be whole nats)
    assert c["loglik_max_abs_diff"] < 1e-3, c
    assert door["acc"] >= 0.5  # far above chance (0.25): the task and the model are both working
    assert Path(report["files"]["json"]).parent == tmp_path
