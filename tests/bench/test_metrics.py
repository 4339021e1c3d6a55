"""The serving-metric arithmetic (vLLM's definitions) on synthetic timestamps."""
from __future__ import annotations

import math

import pytest

from bench.common import ratio, stats, write_docs
from bench.metrics import RequestRecord, meets, summarize


def rec(start, arrivals, end, out_tokens, prompt_tokens=10):
    return RequestRecord(start=start, chunks=arrivals, end=end, prompt_tokens=prompt_tokens, output_tokens=out_tokens)


def test_one_request_ttft_tpot_itl_e2e():
    # Sent at 1.0; tokens arrive at 1.5, 1.7, 2.0 (one per message); stream ends at 2.0.
    r = rec(1.0, [(1.5, 1), (1.7, 1), (2.0, 1)], 2.0, 3)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.0)
    assert r.tpot == pytest.approx((1.0 - 0.5) / 2)
    assert r.itl == pytest.approx([0.2, 0.3])


def test_a_message_with_several_tokens_is_one_itl_gap():
    # 5 tokens in 3 messages: ITL has 2 gaps (one per message), TPOT still divides by 4.
    r = rec(0.0, [(0.1, 1), (0.3, 3), (0.4, 1)], 0.5, 5)
    assert r.itl == pytest.approx([0.2, 0.1])
    assert r.tpot == pytest.approx((0.5 - 0.1) / 4)


def test_single_token_output_has_no_tpot_and_meets_a_tpot_limit():
    r = rec(0.0, [(0.2, 1)], 0.2, 1)
    assert r.tpot is None and r.itl == []
    assert meets(r, {"tpot": 0.001, "ttft": 0.3})
    assert not meets(r, {"ttft": 0.1})


def test_summary_throughput_and_goodput():
    fast = rec(0.0, [(0.1, 1), (0.2, 1)], 0.2, 2)  # ttft 100 ms, tpot 100 ms
    slow = rec(0.0, [(0.9, 1), (1.0, 1)], 1.0, 2)  # ttft 900 ms
    failed = RequestRecord(start=0.0, error="UNAVAILABLE: down")
    s = summarize([fast, slow, failed], duration=2.0, slo={"ttft": 0.5, "tpot": 0.2})
    assert (s["completed"], s["failed"], s["good_requests"]) == (2, 1, 1)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.0)
    assert s["total_token_throughput"] == pytest.approx((2 * 10 + 4) / 2.0)
    assert s["goodput"] == pytest.approx(0.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(500.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(500.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(100 + 0.99 * 800)  # linear interpolation, as numpy
    assert s["itl_ms"]["n"] == 2 and s["errors"] == ["UNAVAILABLE: down"]


def test_no_slo_means_every_completed_request_is_good():
    s = summarize([rec(0.0, [(5.0, 1)], 6.0, 1)], duration=6.0)
    assert s["goodput"] == pytest.approx(s["request_throughput"])


def test_stats_ratio_and_docs_block(tmp_path):
    assert math.isnan(stats([])["mean"]) and stats([None, 2.0], 1e3)["p50"] == pytest.approx(2000.0)
    assert ratio(3.0, 2.0) == "1.50x" and ratio(None, 2.0) == "-"
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# B\n\n## Results\n<!-- bench:kv -->\nold\n<!-- /bench:kv -->\nafter\n")
    write_docs("kv", "| new |", doc)
    write_docs("serve", "| s |", doc)
    text = doc.read_text()
    assert "old" not in text and "| new |" in text and "after" in text and text.count("<!-- bench:kv -->") == 1
    assert text.index("<!-- bench:serve -->") > text.index("after")
