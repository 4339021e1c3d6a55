"""What a verification's extra rows cost on this machine, from the runner's own step timings.

Speculation pays while the tokens a step emits beyond one outweigh what its extra rows cost, so
the engine needs that price in plain decode steps. It depends on the CPU, the kernels (rows are
processed in tiles: a fifth row may cost more than the second to fourth together), the batch and
the context, so rather than a constant it is measured: a running mean of the step time per
(batch size b, rows fed). A plain step of b requests feeds b rows; a request's share of it is
1/b, so i extra rows of one request cost (t(b, b + i) / t(b, b) - 1) * b of its plain steps.

The scheduler prices prompt chunks the same way: the mean time of a step of b requests (whatever
its rows) and the mean seconds per prompt token of the forwards that computed chunks.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepCost:
    weight: float = 0.1  # of the newest step in a running mean (about the last 1/weight steps)
    min_steps: int = 4  # steps of a (batch, rows) pair before its mean is trusted
    _means: dict[tuple[int, int], tuple[float, int]] = field(default_factory=dict)  # -> (seconds, steps)
    _batches: dict[int, tuple[float, int]] = field(default_factory=dict)  # batch -> (seconds, steps), any rows
    _prefill: tuple[float, int] = (0.0, 0)  # (seconds per prompt token, forwards)

    def _next(self, mean_n: tuple[float, int], seconds: float) -> tuple[float, int]:
        mean, n = mean_n
        if n >= self.min_steps:  # a step slowed by another process must not move the mean far
            seconds = min(seconds, 2.0 * mean)
        n += 1
        return mean + max(self.weight, 1.0 / n) * (seconds - mean), n

    def add(self, batch: int, rows: int, seconds: float) -> None:
        """One step of ``batch`` sequences that fed ``rows`` tokens in all, taking ``seconds``."""
        self._means[batch, rows] = self._next(self._means.get((batch, rows), (0.0, 0)), seconds)
        self._batches[batch] = self._next(self._batches.get(batch, (0.0, 0)), seconds)

    def add_prefill(self, tokens: int, seconds: float) -> None:
        """One forward over prompt chunks of ``tokens`` tokens in all, taking ``seconds``."""
        if tokens > 0:
            self._prefill = self._next(self._prefill, seconds / tokens)

    def _mean(self, batch: int, rows: int) -> float | None:
        mean, n = self._means.get((batch, rows), (0.0, 0))
        return mean if n >= self.min_steps and mean > 0 else None

    def step(self, batch: int) -> float | None:
        """Seconds of a step of ``batch`` requests (any rows), from the nearest batch size measured."""
        known = [b for b, (mean, n) in self._batches.items() if n >= self.min_steps and mean > 0]
        if not known:
            return None
        return self._batches[min(known, key=lambda b: (abs(b - batch), b))][0]

    def prefill_token(self) -> float | None:
        """Seconds per prompt token of the forwards that computed chunks, once measured."""
        mean, n = self._prefill
        return mean if n >= self.min_steps and mean > 0 else None

    def plain(self, batch: int) -> float | None:
        """Seconds of a plain step of ``batch`` requests, once measured."""
        return self._mean(batch, batch)

    def extra(self, batch: int, rows: int) -> float | None:
        """``rows`` extra rows of one request in a step of ``batch`` requests, in plain steps of
        that request; None until both that step and a plain one were measured."""
        plain, more = self._mean(batch, batch), self._mean(batch, batch + rows)
        if plain is None or more is None:
            return None
        return max(0.0, more / plain - 1.0) * batch

    def extras(self, batch: int, k: int, per_row: float) -> list[float]:
        """[cost of 0, 1, .., k extra rows] for one request of a ``batch``-request step: measured
        where known, else the last known plus ``per_row`` for each row beyond; never decreasing."""
        out = [0.0]
        for i in range(1, k + 1):
            measured = self.extra(batch, i)
            out.append(max(out[-1], out[-1] + per_row if measured is None else measured))
        return out
