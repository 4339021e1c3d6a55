"""Sampling: validation, greedy limits of top-k/top-p, seeded reproducibility, the distribution."""
from __future__ import annotations

import pytest
import torch

from kvwire import sampler
from kvwire.sampler import argmax, draw, nucleus, probabilities, sample
from kvwire.errors import InvalidRequest
from kvwire.sampling_params import MIN_TEMPERATURE, SamplingParams


@pytest.mark.parametrize("kwargs, msg", [
    (dict(max_tokens=0), "max_tokens must be positive"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be >= 0"),
])
def test_validate_messages(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kwargs).validate()


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    best = int(logits.argmax())
    for step in range(20):
        assert sample(logits, SamplingParams(temperature=1.0, top_k=1, seed=step), step) == best
        assert sample(logits, SamplingParams(temperature=1.0, top_p=1e-6, seed=step), step) == best


def test_top_p_keeps_smallest_prefix_reaching_mass():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert (p > 0).sum() == 3


def _nucleus_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_p, order = torch.sort(probs, descending=True)
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
    return out / out.sum()


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.999, 0.99999])
@pytest.mark.parametrize("sharpness", [0.3, 1.0, 3.0])
def test_nucleus_equals_the_full_sort(top_p, sharpness):
    """The top-k search gives the full sort's nucleus, also where it holds thousands of tokens
    (flat distributions, top_p near 1) and the search grows past its first 64."""
    g = torch.Generator().manual_seed(int(top_p * 1000) + int(sharpness * 10))
    probs = torch.softmax(torch.randn(49152, generator=g) * sharpness, -1)
    got, want = nucleus(probs, top_p), _nucleus_by_full_sort(probs, top_p)
    assert torch.equal(got, want), (int((got > 0).sum()), int((want > 0).sum()))


def test_seed_reproducible_and_steps_differ():
    logits = torch.zeros(1000)
    params = SamplingParams(temperature=1.0, seed=7)
    a = [sample(logits, params, s) for s in range(10)]
    assert a == [sample(logits, params, s) for s in range(10)]
    assert len(set(a)) > 5  # different steps draw differently
    assert a != [sample(logits, SamplingParams(temperature=1.0, seed=8), s) for s in range(10)]


def test_samples_follow_the_distribution():
    # Chi-square goodness of fit over 4000 seeded draws, 5 categories (critical value, df=4, p=0.001: 18.47).
    logits = torch.log(torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05]))
    n = 4000
    counts = torch.zeros(5)
    for s in range(n):
        counts[sample(logits, SamplingParams(temperature=1.0, seed=s), 0)] += 1
    expected = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05]) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.47, (counts, chi2)


def test_draw_follows_unnormalised_weights_and_never_draws_a_zero():
    # Chi-square as above, over weights that do not sum to 1 and hold zeros (a residual, top-p's tail).
    weights = torch.tensor([0.0, 0.8, 0.5, 0.0, 0.2, 0.1, 0.0])
    g = torch.Generator().manual_seed(3)
    counts = torch.zeros(7)
    for _ in range(4000):
        counts[draw(weights, g)] += 1
    assert counts[weights == 0].sum() == 0
    expected = weights[weights > 0] / weights.sum() * 4000
    chi2 = float(((counts[weights > 0] - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (counts, chi2)  # df=3, p=0.001


def test_draw_at_the_top_of_the_range_takes_the_last_positive_weight(monkeypatch):
    # A uniform just below 1 times the total can round up to the total itself: past every entry.
    monkeypatch.setattr(sampler.torch, "rand", lambda *a, **kw: torch.tensor(1.0, dtype=torch.float64))
    assert draw(torch.tensor([0.3, 0.7, 0.0, 0.0]), torch.Generator()) == 1


@pytest.mark.parametrize("weights", [[0.0, 0.0], [float("nan"), 1.0], [float("inf"), 1.0]])
def test_draw_refuses_weights_it_cannot_sample(weights):
    with pytest.raises(ValueError, match="cannot sample"):
        draw(torch.tensor(weights), torch.Generator())


@pytest.mark.parametrize("field,value", [("temperature", float("nan")), ("temperature", float("inf")),
                                         ("temperature", 3e-38), ("temperature", 0.009), ("temperature", -1.0),
                                         ("top_p", float("nan")), ("top_p", float("inf")), ("top_p", 0.0)])
def test_validate_refuses_non_finite_and_tiny_sampling_floats(field, value):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(**{field: value}).validate()


@pytest.mark.parametrize("temperature", [0.0, MIN_TEMPERATURE, 0.7, 5.0])
def test_validate_accepts_greedy_and_usable_temperatures(temperature):
    SamplingParams(temperature=temperature).validate()


def test_argmax_is_torchs_choice_first_maximum_included():
    """The greedy choice goes through numpy for fp32 CPU rows: it must be the index torch.argmax
    gives, row by row, including the first of tied maxima (a different tie-break would change
    greedy output, and speculative verification compares against it)."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 49152, generator=g)
    rows[3, 100] = rows[3, 4000] = rows[3].max() + 1.0  # a tie: 100 comes first
    rows[5, -1] = rows[5].max() + 1.0  # the last index
    assert argmax(rows) == [int(torch.argmax(r)) for r in rows]
    assert argmax(rows)[3] == 100 and argmax(rows)[5] == 49151
    assert argmax(rows[3]) == 100 and isinstance(argmax(rows[3]), int)
    half = rows.to(torch.bfloat16)  # not numpy's: torch decides
    assert argmax(half) == [int(torch.argmax(r)) for r in half]
    assert sample(rows[3], SamplingParams(), 0) == 100


needs_kernels = pytest.mark.skipif(not sampler.cpu_kernels.available(), reason="CPU kernels unavailable")


@needs_kernels
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_kernel_draw_is_the_inverse_cdf_of_the_exact_weights(temperature):
    # Every draw lands where the float64 cumulative weights exp((x - max) / T) put u * total, within
    # the float32 rounding of the weights (1e-6 of the total); a vocabulary not a multiple of 16 or 256.
    g = torch.Generator().manual_seed(11)
    rows = [torch.randn(49159, generator=g) * 4, torch.randn(300, generator=g), torch.full((7,), 2.0)]
    us = torch.rand(400, dtype=torch.float64, generator=g).tolist() + [0.0, 1.0 - 2 ** -53]
    for x in rows:
        w = torch.exp((x.double() - x.double().max()) / temperature)
        cdf = w.cumsum(0)
        total = float(cdf[-1])
        got = sampler.cpu_kernels.sample_rows([x] * len(us), [temperature] * len(us), us)
        for u, i in zip(us, got):
            target, tol = u * total, 1e-6 * total
            assert w[i] > 0
            assert (float(cdf[i - 1]) if i else 0.0) <= target + tol and float(cdf[i]) > target - tol, (u, i)


@needs_kernels
def test_kernel_never_draws_a_masked_token_and_refuses_nan():
    # masked entries first and last: u = 0 must not take the first, u just below 1 (its product with
    # the total can round up to the total) must not take the last
    x = torch.full((1000,), float("-inf"))
    x[[3, 500, 990]] = torch.tensor([0.0, 1.0, -2.0])
    us = [0.0, 1e-12, 0.5, 1.0 - 2 ** -53, 1.0] + torch.rand(200, dtype=torch.float64).tolist()
    assert set(sampler.cpu_kernels.sample_rows([x] * len(us), [0.7] * len(us), us)) == {3, 500, 990}
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[10] = bad
        with pytest.raises(ValueError, match="cannot sample"):
            sample(y, SamplingParams(temperature=1.0, seed=1), 0)


@needs_kernels
def test_sample_rows_equals_sampling_each_row_alone_at_any_thread_count():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(12, 4099, generator=g) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=1.0, top_p=0.9, seed=2), SamplingParams(temperature=1.2, seed=3),
              SamplingParams(temperature=1.0, top_k=5, seed=4), SamplingParams(temperature=1.0, min_p=0.1, seed=5)] * 2
    steps = list(range(12))
    alone = [sample(logits[i], params[i], steps[i]) for i in range(12)]
    assert sampler.sample_rows(list(logits), params, steps) == alone
    us = [sampler.uniform(sampler.step_generator(p.seed, s)) for p, s in zip(params, steps)]
    temps = [max(p.temperature, 0.5) for p in params]
    assert (sampler.cpu_kernels.sample_rows(list(logits), temps, us, threads=1)
            == sampler.cpu_kernels.sample_rows(list(logits), temps, us, threads=2))
