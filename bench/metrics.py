"""Serving metrics from client-side timestamps, with the definitions of vLLM's ``bench serve``.

Method and details: bench/README.md, section ``bench/metrics.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from bench.common import stats


@dataclass
class RequestRecord:
    start: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) per token message
    end: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.chunks)

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def itl(self) -> list[float]:
        return [b[0] - a[0] for a, b in zip(self.chunks, self.chunks[1:])]


def meets(r: RequestRecord, slo: dict[str, float]) -> bool:
    """slo keys (seconds): ttft, tpot, e2el; a missing key is no limit."""
    tpot = r.tpot if r.tpot is not None else 0.0
    return (r.ttft <= slo.get("ttft", float("inf")) and tpot <= slo.get("tpot", float("inf"))
            and r.e2e <= slo.get("e2el", float("inf")))


def summarize(records: list[RequestRecord], duration: float, slo: dict[str, float] | None = None) -> dict:
    """Latencies in ms (mean/p50/p99), throughputs per second; see the module docstring."""
    done = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    good = sum(meets(r, slo or {}) for r in done)
    return {"completed": len(done), "failed": len(records) - len(done), "duration_s": duration,
            "input_tokens": in_tokens, "output_tokens": out_tokens,
            "request_throughput": len(done) / duration, "output_throughput": out_tokens / duration,
            "total_token_throughput": (in_tokens + out_tokens) / duration,
            "goodput": good / duration, "good_requests": good,
            "ttft_ms": stats([r.ttft for r in done], 1e3), "tpot_ms": stats([r.tpot for r in done], 1e3),
            "itl_ms": stats([g for r in done for g in r.itl], 1e3), "e2el_ms": stats([r.e2e for r in done], 1e3),
            "errors": sorted({r.error for r in records if r.error})[:5]}
