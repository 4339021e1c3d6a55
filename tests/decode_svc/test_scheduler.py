"""Scheduler: admission against the page budget, bounded FIFO queue, release on finish."""
from __future__ import annotations

import pytest

from decode_svc.scheduler import AdmissionError, Phase, Scheduler, SchedulerConfig


def make(total=10, **kw):
    return Scheduler(SchedulerConfig(total_pages=total, block_size=16, **kw))


def test_admits_while_pages_fit_fifo():
    s = make(total=10)
    a = s.submit("a", 40, 24)  # 4 pages
    b = s.submit("b", 40, 24)  # 4 pages
    c = s.submit("c", 10, 6)  # 1 page, but behind b: no overtaking
    assert [x.request_id for x in s.admit()] == ["a", "b", "c"]
    assert s.reserved == 9 and all(x.phase is Phase.PREFILLING for x in (a, b, c))
    d = s.submit("d", 30, 2)  # 2 pages: does not fit beside 9
    assert s.admit() == [] and d.phase is Phase.WAITING
    s.finish("a")
    assert s.admit() == [d] and s.reserved == 7


def test_head_of_line_blocks_smaller_requests():
    s = make(total=5)
    s.submit("big", 60, 4)
    s.admit()
    s.submit("big2", 60, 4)
    s.submit("small", 1, 1)
    assert s.admit() == []  # big2 waits for pages; small does not overtake it


def test_never_fits_and_queue_full():
    s = make(total=4, max_waiting=2)
    with pytest.raises(AdmissionError, match="needs 5 KV pages .* pool has 4"):
        s.submit("x", 70, 10)
    s.submit("a", 63, 1)
    s.submit("b", 63, 1)
    with pytest.raises(AdmissionError, match="queue is full"):
        s.submit("c", 1, 1)


def test_finish_is_idempotent_and_removes_waiting():
    s = make(total=2)
    s.submit("a", 16, 16)
    s.admit()
    s.submit("b", 16, 16)
    s.finish("b")
    assert not s.waiting
    s.finish("a")
    s.finish("a")
    assert s.reserved == 0 and not s.running


def test_sliding_window_caps_reservation():
    s = make(total=100, sliding_window=32)
    assert s.pages_needed(1000, 1000) == 4
    assert s.pages_needed(10, 5) == 1


def test_max_running():
    s = make(total=100, max_running=2)
    for r in "abc":
        s.submit(r, 1, 1)
    assert len(s.admit()) == 2 and len(s.waiting) == 1
