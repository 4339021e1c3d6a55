"""N-gram proposals (longest suffix match, proposal length from the match and the row price) and
the measured row price (StepCost)."""
from __future__ import annotations

import dataclasses

import pytest

from kvwire import SamplingParams
from kvwire.engine.request import Request
from kvwire.engine.step_cost import StepCost
from kvwire.sampling_params import SpeculativeMode
from kvwire.spec import SpecConfig, SpecState, Tuned
from kvwire.spec import ngram as spec
from kvwire.spec.ngram import lookup_length, ngram_match
from kvwire.spec.state import row_costs


def test_ngram_match_finds_the_longest_suffix_at_its_latest_place():
    #      0  1  2  3  4  5  6  7  8  9 10 11 12 13
    ctx = [1, 2, 3, 4, 9, 2, 3, 4, 8, 7, 1, 2, 3, 4]
    assert ngram_match(ctx, 16) == (4, 4)  # "1 2 3 4" at 0..3 beats the later "2 3 4" at 5..7
    assert ngram_match(ctx, 3) == (3, 8)  # capped at 3 tokens: "2 3 4", latest at 5..7
    assert ngram_match(ctx, 16, min_n=5) == (0, 0)
    assert ngram_match([5, 5, 5, 5], 16) == (3, 3)  # overlapping: "5 5 5" at 0..2, followed by index 3
    assert ngram_match([1, 2, 3], 4) == (0, 0) and ngram_match([7], 4) == (0, 0)
    assert spec.ngram_propose(ctx, 3, max_n=16) == [9, 2, 3]


def _lin(c: float, k: int) -> list[float]:
    return [c * i for i in range(k + 1)]


def test_lookup_length_grows_with_the_match_and_shrinks_with_the_price():
    # s = 1 - 0.8 / n; the i with the most (1 + s + .. + s**i) / (1 + extra[i])
    assert lookup_length(1, _lin(0.3, 8), 0.8) == 0  # s = 0.2: 1.2 / 1.3 < 1
    assert lookup_length(2, _lin(0.3, 8), 0.8) == 1  # s = 0.6: 1.6 / 1.3 > 1.96 / 1.6
    assert lookup_length(3, _lin(0.3, 8), 0.8) == 2  # s = 0.73: 2.27 / 1.6 > 2.67 / 1.9
    assert lookup_length(16, _lin(0.3, 32), 0.8) == 8  # s = 0.95: 7.40 / 3.4 > 8.03 / 3.7
    assert lookup_length(16, _lin(0.3, 4), 0.8) == 4  # capped at k
    assert lookup_length(16, _lin(0.1, 32), 0.8) == 15  # cheaper rows: longer proposals
    assert lookup_length(2, _lin(0.7, 8), 0.8) == 0  # s = 0.6 does not pay 0.7 a row
    # rows priced in tiles: the fifth costs as much as the first four, so it stops at four
    assert lookup_length(16, [0, 0.1, 0.2, 0.3, 0.4, 1.4, 1.5, 1.6, 1.7], 0.8) == 4
    assert lookup_length(3, _lin(0.0, 5), 0.8) == 5 and lookup_length(3, _lin(0.3, 5), 0.0) == 5  # free / sure
    assert lookup_length(0, _lin(0.3, 8), 0.8) == 0 and lookup_length(5, [0.0], 0.8) == 0


def _req(greedy=True, mode=SpeculativeMode.NGRAM) -> Request:
    params = SamplingParams(max_tokens=100) if greedy else SamplingParams(max_tokens=100, temperature=1.0, seed=3)
    return Request("r", 0, [1], params, frozenset(), SpecState(mode, k_max=8, k=8), generated=1)


def test_ngram_proposal_sizes_itself_from_the_match():
    cfg = SpecConfig()
    req = _req()
    req.context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 40, 1, 2, 3, 4]
    req.spec.costs = _lin(0.3, 8)
    assert spec.ngram_proposal(req, 8, cfg) == [5, 6]  # 4-token match: s = 0.75, 2 make the most
    assert spec.ngram_proposal(req, 8, dataclasses.replace(cfg, tuned=Tuned(ngram_miss=0.8))) == [5, 6, 7]  # s = 0.8: 3
    assert spec.ngram_proposal(req, 1, cfg) == [5]  # at most k
    assert spec.ngram_proposal(req, 8, dataclasses.replace(cfg, ngram_max=1)) == []  # 1-token match: none pays
    req.spec.costs = _lin(0.02, 8)
    assert spec.ngram_proposal(req, 8, cfg) == [5, 6, 7, 8, 9, 10, 11, 12]  # cheap rows: all there is
    req.spec.costs = _lin(0.3, 8)
    assert spec.ngram_proposal(req, 3, dataclasses.replace(cfg, adaptive=False, ngram_max=1)) == [5, 6, 7]


def _fed(cost: StepCost, batch: int, extra: list[int], base: float, per_row: float) -> None:
    for x in extra:
        cost.add(batch, batch + x, base + per_row * x)


def test_step_cost_prices_rows_per_batch_size_from_step_times():
    cost = StepCost(min_steps=4)
    _fed(cost, 1, [0, 1, 4] * 3, 0.010, 0.003)
    assert cost.extra(1, 1) is None  # 3 steps of each: not yet
    _fed(cost, 1, [0, 1, 4], 0.010, 0.003)
    assert cost.extra(1, 1) == pytest.approx(0.3) and cost.extra(1, 4) == pytest.approx(1.2)
    # unmeasured counts: the last measured plus the fallback per row; never decreasing
    assert cost.extras(1, 6, per_row=0.5) == pytest.approx([0, 0.3, 0.8, 1.3, 1.3, 1.8, 2.3])  # 4: 1.2 < 1.3
    # a batch of 4: a plain step takes 20 ms, a request's share 5 ms; 2 rows of one request add 4 ms
    _fed(cost, 4, [0, 2] * 4, 0.020, 0.002)
    assert cost.extra(4, 2) == pytest.approx(0.8) and cost.extra(2, 1) is None
    assert StepCost().extras(3, 3, per_row=0.3) == pytest.approx([0, 0.3, 0.6, 0.9])  # nothing measured
    # the price follows the machine (new kernels): old steps fade out
    _fed(cost, 1, [0, 1] * 60, 0.010, 0.001)
    assert cost.extra(1, 1) == pytest.approx(0.1, abs=0.01)


def test_step_cost_a_stalled_step_moves_the_price_little():
    cost = StepCost(min_steps=4)
    _fed(cost, 1, [0, 1] * 8, 0.010, 0.003)
    cost.add(1, 1, 1.0)  # a plain step that another process held up for a second
    assert 0.15 < cost.extra(1, 1) < 0.3  # unclipped it would read about -0.9 (0)


def test_measured_price_is_used_by_greedy_ngram_requests_only():
    cfg = SpecConfig(tuned=Tuned(ngram_cost=0.3, draft_cost=0.6))
    cost = StepCost(min_steps=4)
    assert row_costs(_req(), 1, cfg, cost) == pytest.approx(_lin(0.3, 8))  # nothing measured yet
    _fed(cost, 1, [0, 1, 2] * 4, 0.010, 0.001)
    assert row_costs(_req(), 1, cfg, cost)[:4] == pytest.approx([0, 0.1, 0.2, 0.5])
    assert row_costs(_req(), 2, cfg, cost) == pytest.approx(_lin(0.3, 8))  # another batch size
    assert row_costs(_req(greedy=False), 1, cfg, cost) == pytest.approx(_lin(0.3, 8))  # seeded: no timing
    assert row_costs(_req(mode=SpeculativeMode.DRAFT), 1, cfg, cost) == pytest.approx(_lin(0.6, 8))
    fixed = dataclasses.replace(cfg, tuned=Tuned(ngram_cost=0.3, draft_cost=0.6, measure_cost=False))
    assert row_costs(_req(), 1, fixed, cost) == pytest.approx(_lin(0.3, 8))


def test_a_steps_lookups_are_computed_once_per_context(monkeypatch):
    """A draft head's request asks the lookup up to three times a step: one ngram_match per
    context (and per lookup setting); a longer context is a new one."""
    calls = []
    real = spec.ngram_match
    monkeypatch.setattr(spec, "ngram_match", lambda *a: calls.append(a) or real(*a))
    cfg = SpecConfig()
    req = _req()
    req.context = [1, 2, 3, 4, 5, 6, 7, 8, 40, 1, 2, 3, 4]
    assert spec.lookup(req, cfg) == spec.lookup(req, cfg) == (4, 4)
    assert len(calls) == 1
    req.context.append(5)  # the step's token: a new context
    assert spec.lookup(req, cfg) == (5, 5) and len(calls) == 2
    assert spec.lookup(req, dataclasses.replace(cfg, ngram_max=2)) == (2, 5) and len(calls) == 3
