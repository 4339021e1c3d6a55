"""Logits processing against oracles nobody here wrote (transformers' logits processors) and a
token-by-token reference for what transformers does not have (OpenAI's frequency/presence penalties)."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor)

from kvwire.errors import InvalidRequest
from kvwire.logits_process import RowContext, apply, process
from kvwire.sampler import probabilities, sample_first
from kvwire.sampling_params import SamplingParams

VOCAB = 97


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3  # [n, vocab]


def _history(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 20, (n,), generator=g).tolist()  # few distinct ids: repeats


def test_repetition_penalty_is_transformers_per_row():
    logits = _logits(3)
    rows = [RowContext(SamplingParams(repetition_penalty=p), _history(i, 9), _history(10 + i, 5))
            for i, p in enumerate((1.3, 0.7, 2.0))]
    got = apply(logits, rows)
    for i, c in enumerate(rows):
        ids = torch.tensor([[*c.prompt, *c.output]])
        want = RepetitionPenaltyLogitsProcessor(c.params.repetition_penalty)(ids, logits[i:i + 1].clone())
        torch.testing.assert_close(got[i], want[0], rtol=0, atol=0)


def test_frequency_and_presence_penalties_over_generated_tokens_only():
    logits = _logits(2, seed=1)
    rows = [RowContext(SamplingParams(frequency_penalty=0.5, presence_penalty=1.5), _history(1, 12), _history(2, 8)),
            RowContext(SamplingParams(frequency_penalty=-1.0, presence_penalty=0.25), [3, 4], [4, 4, 4, 9])]
    got = apply(logits, rows)
    for i, c in enumerate(rows):
        want = logits[i].clone()
        for t in set(c.output):  # OpenAI's formula, token by token
            want[t] -= c.params.frequency_penalty * c.output.count(t) + c.params.presence_penalty
        torch.testing.assert_close(got[i], want)


def test_min_tokens_masks_stops_until_reached_like_transformers():
    logits = _logits(3, seed=2)
    params = SamplingParams(min_tokens=3, max_tokens=8)
    stops = frozenset({5, 17})
    rows = [RowContext(params, [1, 2], [7] * n, stops) for n in (0, 2, 3)]
    got = apply(logits, rows)
    for i, c in enumerate(rows):
        oracle = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=2, min_new_tokens=3,
                                                   eos_token_id=sorted(stops))
        want = oracle(torch.tensor([[*c.prompt, *c.output]]), logits[i:i + 1].clone())[0]
        assert torch.equal(got[i], want)
    assert torch.isinf(got[1, 5]) and torch.isfinite(got[2, 5])


def test_logit_bias_is_clamped_and_added_like_transformers_sequence_bias():
    logits = _logits(1, seed=3)
    bias = {4: 3.5, 10: -250.0, 11: 180.0}
    got = apply(logits, [RowContext(SamplingParams(logit_bias=bias), [1], [])])
    clamped = {(t,): max(-100.0, min(100.0, b)) for t, b in bias.items()}
    want = SequenceBiasLogitsProcessor(sequence_bias=[[list(k), v] for k, v in clamped.items()])(
        torch.tensor([[1]]), logits.clone())
    torch.testing.assert_close(got, want)


def test_order_is_min_tokens_bias_then_penalties_as_vllm():
    logits = _logits(1, seed=4)
    p = SamplingParams(min_tokens=2, max_tokens=5, logit_bias={6: 2.0}, repetition_penalty=1.5,
                       frequency_penalty=0.3, presence_penalty=0.2)
    c = RowContext(p, [6, 8], [6], frozenset({9}))
    want = logits[0].clone()
    want[9] = -math.inf
    want[6] += 2.0
    for t in (6, 8):
        want[t] = want[t] / 1.5 if want[t] > 0 else want[t] * 1.5
    want[6] -= 0.3 + 0.2
    torch.testing.assert_close(apply(logits, [c])[0], want)


def test_rows_that_ask_nothing_are_untouched_and_free():
    logits = _logits(3, seed=5)
    plain = RowContext(SamplingParams(temperature=0.7, top_p=0.9), [1], [2])
    assert process(logits, [plain] * 3) is logits  # no copy, no work
    mixed = process(logits, [plain, RowContext(SamplingParams(presence_penalty=1.0), [1], [2]), plain])
    assert torch.equal(mixed[0], logits[0]) and torch.equal(mixed[2], logits[2])
    assert mixed[1, 2] == logits[1, 2] - 1.0


@pytest.mark.parametrize("min_p, temperature", [(0.05, 1.0), (0.3, 0.7), (0.9, 1.5)])
def test_min_p_is_transformers_min_p_warper(min_p, temperature):
    logits = _logits(1, seed=6)[0]
    got = probabilities(logits, SamplingParams(temperature=temperature, min_p=min_p))
    warped = MinPLogitsWarper(min_p)(None, (logits / temperature)[None])[0]
    torch.testing.assert_close(got, torch.softmax(warped, -1))
    assert 1 <= int((got > 0).sum()) < VOCAB


def test_first_token_sees_the_prompt_and_holds_stops_back():
    logits = torch.full((VOCAB,), -5.0)
    logits[3], logits[4] = 10.0, 9.0  # 3 (in the prompt) is the favourite, 4 the runner-up
    assert sample_first(logits, SamplingParams(), [3, 3], frozenset()) == 3
    assert sample_first(logits, SamplingParams(repetition_penalty=2.0), [3, 3], frozenset()) == 4
    assert sample_first(logits, SamplingParams(min_tokens=1), [1], frozenset({3})) == 4
    assert sample_first(logits, SamplingParams(logit_bias={7: 100}), [1], frozenset()) == 7


@pytest.mark.parametrize("kwargs, msg", [
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(logit_bias={1: float("inf")}), "logit_bias values must be finite"),
    (dict(min_tokens=-1), "min_tokens must be >= 0"),
    (dict(min_tokens=9, max_tokens=8), "min_tokens .* must not exceed max_tokens"),
    (dict(logprobs=21), r"logprobs must be in \[0, 20\]"),
])
def test_validation_names_the_field(kwargs, msg):
    with pytest.raises(InvalidRequest, match=msg):
        SamplingParams(**kwargs).validate()
