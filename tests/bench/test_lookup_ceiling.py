"""bench/lookup_ceiling.py: prompt lookup's best case, replayed over known outputs."""
from __future__ import annotations

import pytest

from bench.lookup_ceiling import ceiling


def test_a_fully_quoted_answer_is_bounded_by_k_and_the_row_prices():
    doc = list(range(100, 140))
    out = doc[:1] + doc[1:21]  # the answer copies the document: 1 first token + 20 decoded
    # every step proposes k = 4 tokens, all accepted, and adds the target's own: 4 steps of 5
    assert ceiling([(doc, out)], [0.0] * 5, k=4) == pytest.approx(20 / 4)
    assert ceiling([(doc, out)], [0.0, 0.1, 0.2, 0.3, 0.4], k=4) == pytest.approx(20 / (4 * 1.4))
    # one token shorter: the last step may propose only 3 (its last token is the target's)
    assert ceiling([(doc, out[:-1])], [0.0, 0.1, 0.2, 0.3, 0.4], k=4) == pytest.approx(19 / (3 * 1.4 + 1.3))


def test_new_text_gets_nothing_and_pays_nothing():
    prompt, out = [1, 2, 3], [7, 8, 9, 10, 11]  # no token of the answer occurred before
    assert ceiling([(prompt, out)], [0.0, 0.5, 0.9], k=2) == pytest.approx(1.0)


def test_any_match_finds_a_continuation_the_latest_match_misses():
    # 5 occurs twice: the latest occurrence continues 9, 9; the earlier one 6, 7 (what comes). The
    # latest-match lookup misses once, then matches "5 6" and proposes 7.
    prompt = [5, 6, 7, 1, 5, 9, 9, 2]
    out = [5, 6, 7, 3]
    latest = ceiling([(prompt, out)], [0.0, 0.1, 0.2], k=2, lookup="latest")
    best = ceiling([(prompt, out)], [0.0, 0.1, 0.2], k=2, lookup="any_match")
    assert latest == pytest.approx(3 / (1.0 + 1.1))  # 6 alone, then 7 proposed and accepted + 3
    assert best == pytest.approx(3 / 1.2)  # 6, 7 proposed and accepted, then 3: one step


def test_prices_must_cover_k_and_the_lookup_must_be_known():
    with pytest.raises(ValueError, match="3 prices"):
        ceiling([([1], [1, 2])], [0.0, 0.1], k=2)
    with pytest.raises(ValueError, match="lookup must be"):
        ceiling([([1], [1, 2])], [0.0, 0.1, 0.2], k=2, lookup="best")
