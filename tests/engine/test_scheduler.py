"""Scheduler: admission against the page budget, bounded FIFO queue, the step's batch, update;
and BlockTables.max_pages, the one reservation rule (window and speculative lookahead included)."""
from __future__ import annotations

import random

import pytest

from kvwire.engine.request import Request, RequestStatus
from kvwire.engine.scheduler import Scheduler, SchedulerConfig
from kvwire.errors import ResourceExhausted
from kvwire.kv.pool import BlockTables, PagePool
from kvwire.sampling_params import FinishReason, SamplingParams, SpeculativeMode
from kvwire.spec import SpecState

_seq = iter(range(10**6))


def make(total=10, window=None, **kw):
    tables = BlockTables(PagePool(total), 16, window)
    return Scheduler(SchedulerConfig(total_pages=total, **kw), tables.max_pages)


def req(rid, prompt_len, max_tokens, k=0, stops=()):
    return Request(rid, next(_seq), [1] * prompt_len, SamplingParams(max_tokens=max_tokens), frozenset(stops),
                   SpecState(SpeculativeMode.NGRAM, k_max=k, k=k) if k else None)


def test_admits_while_pages_fit_fifo():
    s = make(total=10)
    a, b, c = req("a", 40, 24), req("b", 40, 24), req("c", 10, 6)  # 4, 4, 1 pages; c behind b
    for r in (a, b, c):
        s.add(r)
    batch = s.schedule()
    assert [r.request_id for r in batch.admitted] == ["a", "b", "c"] and batch.decode == ()
    assert s.reserved == 9 and all(r.status is RequestStatus.PREFILLING for r in (a, b, c))
    d = req("d", 30, 2)  # 2 pages: does not fit beside 9
    s.add(d)
    assert s.schedule().admitted == () and d.status is RequestStatus.WAITING
    s.finish(a)
    assert s.schedule().admitted == (d,) and s.reserved == 7


def test_head_of_line_blocks_smaller_requests():
    s = make(total=5)
    s.add(req("big", 60, 4))
    s.schedule()
    s.add(req("big2", 60, 4))
    s.add(req("small", 1, 1))
    assert s.schedule().admitted == ()  # big2 waits for pages; small does not overtake it


def test_never_fits_and_queue_full():
    s = make(total=4, max_waiting=2)
    with pytest.raises(ResourceExhausted, match="needs 5 KV pages .* pool has 4"):
        s.add(req("x", 70, 10))
    s.add(req("a", 63, 1))
    s.add(req("b", 63, 1))
    with pytest.raises(ResourceExhausted, match="queue is full"):
        s.add(req("c", 1, 1))


def test_finish_is_idempotent_and_removes_waiting():
    s = make(total=2)
    a, b = req("a", 16, 16), req("b", 16, 16)
    s.add(a)
    s.schedule()
    s.add(b)
    s.finish(b)
    assert not s.waiting
    s.finish(a)
    s.finish(a)
    assert s.reserved == 0 and not s.running


def test_max_running():
    s = make(total=100, max_running=2)
    for r in "abc":
        s.add(req(r, 1, 1))
    assert len(s.schedule().admitted) == 2 and len(s.waiting) == 1


def test_batch_and_update_cut_at_stop_or_length():
    s = make(total=100)
    a, b, c = req("a", 4, 10, stops=[99]), req("b", 4, 3), req("c", 4, 10)
    for r in (a, b, c):
        s.add(r)
    s.schedule()
    assert s.start(a, 7).token_ids == [7] and s.start(b, 8).finish_reason is None
    assert s.start(c, 99).finish_reason is None  # 99 stops a, not c
    batch = s.schedule()
    assert batch.admitted == () and batch.decode == (a, b, c)
    s.finish(c)  # aborted while the step ran: its tokens are dropped
    outs = s.update(batch, [[5, 99, 6], [1, 2, 3], [4]])
    assert [(o.request_id, o.token_ids, o.finish_reason) for o in outs] == [
        ("a", [5, 99], FinishReason.STOP), ("b", [1, 2], FinishReason.LENGTH)]
    assert a.output_ids == [7, 5, 99] and s.schedule().decode == ()


def test_max_pages_without_window_is_the_whole_sequence():
    t = BlockTables(PagePool(1000), 16)
    assert t.max_pages(10, 10 + 5) == 1 and t.max_pages(100, 100 + 100, lookahead=8) == 13


@pytest.mark.parametrize("window, prompt_len, k", [(32, 1000, 0), (32, 10, 4), (40, 200, 7), (16, 3, 16)])
def test_max_pages_bounds_a_windowed_speculative_sequence(window, prompt_len, k):
    """Run the block tables as the engine does (prompt at once, then steps of 1 + k tokens with a
    random number kept) and check the pages held never exceed max_pages, which is also reached
    or nearly reached (the bound is not loose by more than a page)."""
    max_tokens = 300
    tables = BlockTables(PagePool(1000), 16, window)
    bound = tables.max_pages(prompt_len, prompt_len + max_tokens, k)
    rng = random.Random(window + prompt_len + k)
    tables.add(0)
    tables.append([(0, prompt_len)])
    peak, generated = len(tables.live_pages(0)), 1
    while generated < max_tokens:
        n = 1 + min(k, max_tokens - generated - 1)  # the engine never proposes past max_tokens
        tables.release_outside_window(0)
        before = tables.length(0)
        tables.append([(0, n)])
        peak = max(peak, len(tables.live_pages(0)))
        kept = rng.randint(1, n)
        tables.truncate(0, before + kept)
        generated += kept
    assert peak <= bound
    assert peak >= bound - 1
