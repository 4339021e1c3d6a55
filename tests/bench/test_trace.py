"""bench.trace's drawing helpers on a hand-made trace (the full run, with the three real services,
is ``python -m bench trace``; tests/integration/test_trace_metrics.py checks the trace itself)."""
from __future__ import annotations

from bench import trace
from tools.otlp_receiver import ReceivedSpan


def span(sid, parent, name, service, start_ms, end_ms, kind=1):
    return ReceivedSpan("t" * 32, sid, parent, name, kind, service, {}, 0, int(start_ms * 1e6), int(end_ms * 1e6))


SPANS = [
    span("d", "c", "/kvwire.v1.DecodeService/GenerateTokens", "kvwire-decode", 2, 90, kind=2),
    span("a", "", "/kvwire.v1.TokenizerService/GenerateText", "kvwire-tokenizer", 0, 100, kind=2),
    span("k", "d", "kv_transfer", "kvwire-decode", 3, 40),
    span("c", "a", "/kvwire.v1.DecodeService/GenerateTokens", "kvwire-tokenizer", 1, 95, kind=3),
    span("t", "a", "tokenize", "kvwire-tokenizer", 0.5, 0.8),
]


def test_rows_are_depth_first_by_start_time_with_readable_labels():
    rows = [(s.span_id, depth, trace.label(s)) for s, depth in trace.tree_order(SPANS)]
    assert rows == [("a", 0, "tokenizer: GenerateText (server)"), ("t", 1, "tokenizer: tokenize"),
                    ("c", 1, "tokenizer: GenerateTokens (client)"), ("d", 2, "decode: GenerateTokens (server)"),
                    ("k", 3, "decode: kv_transfer")]


def test_draw_writes_a_png(tmp_path):
    rows = [{"label": trace.label(s), "service": s.service_name, "depth": d, "start_ms": s.start_ns / 1e6,
             "duration_ms": (s.end_ns - s.start_ns) / 1e6} for s, d in trace.tree_order(SPANS)]
    path = trace.draw(rows, tmp_path / "w.png", "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
