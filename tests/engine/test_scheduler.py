"""Scheduler: admission against the pages free, bounded FIFO queue, growth and preemption, the
step's plan (decode rows, then prompt chunks within the token budget), update; and
BlockTables.max_pages, the one reservation rule (window and speculative lookahead included)."""
from __future__ import annotations

import random

import pytest

from kvwire.engine.request import Request, RequestStatus
from kvwire.engine.scheduler import Scheduler, SchedulerConfig
from kvwire.errors import ResourceExhausted
from kvwire.kv.pool import BlockTables, OutOfPages, PagePool
from kvwire.sampling_params import FinishReason, SamplingParams, SpeculativeMode
from kvwire.spec import SpecState

_seq = iter(range(10**6))


def make(total=10, window=None, **kw):
    tables = BlockTables(PagePool(total), 16, window)
    return Scheduler(SchedulerConfig(total_pages=total, **kw), tables.max_pages)


def req(rid, prompt_len, max_tokens, k=0, stops=()):
    return Request(rid, next(_seq), [1] * prompt_len, SamplingParams(max_tokens=max_tokens), frozenset(stops),
                   SpecState(SpeculativeMode.NGRAM, k_max=k, k=k) if k else None)


def admit_local(s):
    """Admit, every new request prefilling here (as LLM does); returns them."""
    admitted = s.admit()
    for r in admitted:
        s.prefill_locally(r)
    return admitted


def run_prefill(s, plan):
    """Pretend the plan's replays and chunks ran; start the requests whose prompt completed (first token 7)."""
    for c in plan.replays:
        s.replay_done(c)
    for c in plan.chunks:
        if s.chunk_done(c, c.end) and not c.req.resuming:
            s.start(c.req, 7)


def test_admits_by_what_the_prompt_needs_now_fifo():
    s = make(total=10)
    a, b, c = req("a", 40, 100), req("b", 40, 100), req("c", 10, 6)  # 3, 3, 1 pages now (prompt + first token)
    for r in (a, b, c):
        s.add(r)
    assert s.admit() == [a, b, c] and s.reserved == 7
    assert all(r.status is RequestStatus.PREFILLING for r in (a, b, c))
    d = req("d", 50, 2)  # 4 pages: does not fit beside 7
    s.add(d)
    assert s.admit() == [] and d.status is RequestStatus.WAITING
    s.finish(a)
    assert s.admit() == [d] and s.reserved == 8


def test_the_watermark_keeps_a_page_of_growth_per_running_request():
    s = make(total=6)
    a = req("a", 16, 60)
    s.add(a)
    s.admit()
    s.start(a, 1)  # running: 2 pages reserved (16 prompt tokens + 1)
    b = req("b", 50, 1)  # 4 pages: 2 + 4 fits 6, but not with a's next page kept free
    s.add(b)
    assert s.admit() == [] and s.reserved == 2
    s.finish(a)
    assert s.admit() == [b]


def test_head_of_line_blocks_smaller_requests():
    s = make(total=5)
    s.add(req("big", 60, 4))
    s.admit()
    s.add(req("big2", 60, 4))
    s.add(req("small", 1, 1))
    assert s.admit() == []  # big2 waits for pages; small does not overtake it


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
    s.admit()
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
    assert len(s.admit()) == 2 and len(s.waiting) == 1


def test_plan_and_update_cut_at_stop_or_length():
    s = make(total=100)
    a, b, c = req("a", 4, 10, stops=[99]), req("b", 4, 3), req("c", 4, 10)
    for r in (a, b, c):
        s.add(r)
    s.admit()
    assert s.start(a, 7).token_ids == [7] and s.start(b, 8).finish_reason is None
    assert s.start(c, 99).finish_reason is None  # 99 stops a, not c
    plan = s.plan()
    assert plan.chunks == () and plan.decode == (a, b, c)
    s.finish(c)  # aborted while the step ran: its tokens are dropped
    outs = s.update(plan, [[5, 99, 6], [1, 2, 3], [4]])
    assert [(o.request_id, o.token_ids, o.finish_reason) for o in outs] == [
        ("a", [5, 99], FinishReason.STOP), ("b", [1, 2], FinishReason.LENGTH)]
    assert a.output_ids == [7, 5, 99] and s.plan().decode == ()


def test_chunks_are_cut_at_fixed_places_and_fill_the_budget_oldest_first():
    s = make(total=100, max_num_batched_tokens=64, prefill_chunk=32)
    d = req("d", 4, 50, k=3)
    s.add(d)
    admit_local(s)
    run_prefill(s, s.plan())
    a, b, c = req("a", 50, 4), req("b", 40, 4), req("c", 20, 4)
    for r in (a, b, c):
        s.add(r)
    admit_local(s)
    plan = s.plan()  # d decodes 1 + 3 rows: 60 tokens left: a's two chunks (50); b's first 32 would pass it
    assert plan.decode == (d,) and [(x.req, x.start, x.end) for x in plan.chunks] == [(a, 0, 32), (a, 32, 50)]
    run_prefill(s, plan)
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.PREFILLING and b.computed == 0
    plan = s.plan()  # a decodes too now: 59 left, b's 32 + 8; c's 20 would pass it
    assert [(x.req, x.start, x.end) for x in plan.chunks] == [(b, 0, 32), (b, 32, 40)]
    run_prefill(s, plan)
    assert [(x.req, x.start, x.end) for x in s.plan().chunks] == [(c, 0, 20)]
    # FIFO: a younger prompt's chunk never passes an older one's that did not fit
    s1 = make(total=100, max_num_batched_tokens=40, prefill_chunk=32)
    for r in (req("p", 64, 4), req("q", 4, 4)):
        s1.add(r)
    admit_local(s1)
    assert [(x.req.request_id, x.start, x.end) for x in s1.plan().chunks] == [("p", 0, 32)]
    # the oldest prompt's chunk goes whatever decode takes of the budget
    s2 = make(total=100, max_num_batched_tokens=2, prefill_chunk=16)
    s2.add(req("e", 40, 4))
    admit_local(s2)
    assert [x.end for x in s2.plan().chunks] == [16]
    s3 = make(total=100, max_num_batched_tokens=310, prefill_chunk=None)  # no chunking: whole prompts
    s3.add(req("f", 300, 4))
    s3.add(req("g", 30, 4))
    admit_local(s3)
    assert [(x.req.request_id, x.end) for x in s3.plan().chunks] == [("f", 300)]


def test_the_youngest_is_preempted_and_resumes_from_its_tokens():
    s = make(total=4)  # 16-token pages
    old, young = req("old", 15, 40), req("young", 15, 40)
    for r in (old, young):
        s.add(r)
    assert admit_local(s) == [old, young]
    run_prefill(s, s.plan())
    s.update(s.plan(), [[1], [1]])  # 17 tokens in context each: 2 pages reserved each
    plan = s.plan()
    assert plan.preempted == () and s.reserved == 4
    s.update(plan, [[2] * 16, [2] * 16])  # 33 each: both need a third page, the pool has 4
    plan = s.plan()
    assert plan.preempted == (young,) and plan.decode == (old,) and s.reserved == 3
    assert young.status is RequestStatus.WAITING and s.waiting[0] is young and s.num_preemptions == 1
    assert young.output_ids == [7, 1] + [2] * 16  # its tokens are kept
    s.finish(old)
    assert s.admit() == []  # readmitted, not new: its KV is recomputed here
    assert young.status is RequestStatus.PREFILLING and young.prefill_tokens == young.prompt
    plan = s.plan()  # its prompt again, in the same chunks
    assert [(c.start, c.end) for c in plan.chunks] == [(0, 15)] and plan.replays == ()
    run_prefill(s, plan)
    plan = s.plan()  # then its generated tokens but the pending one, fed as decoding fed them
    assert plan.chunks == () and [(c.tokens[c.start:c.end], c.start) for c in plan.replays] == [([7, 1] + [2] * 15, 15)]
    run_prefill(s, plan)
    assert young.status is RequestStatus.RUNNING and young.generated == 18  # decodes on from its pending token
    assert s.plan().decode == (young,)


def test_a_request_whose_kv_is_imported_is_never_preempted():
    s = make(total=4)
    a, remote = req("a", 15, 40), req("remote", 20, 20)
    s.add(a)
    admit_local(s)
    run_prefill(s, s.plan())
    s.add(remote)
    assert s.admit() == [remote]  # a remote source fills it: not prefill_locally
    s.update(s.plan(), [[1] * 17])  # a: 33 tokens, needs a third page; remote holds 2
    plan = s.plan()
    assert plan.preempted == (a,) and remote.status is RequestStatus.PREFILLING  # a preempted itself


@pytest.mark.parametrize("seed", range(6))
def test_reservations_cover_every_page_under_preemption(seed):
    """Drive the scheduler against real block tables as the engine does (chunks, decode steps with
    random speculative rows kept, random lengths, a small pool): the tables never run out of
    pages, every request finishes with all its tokens, and preemptions happen."""
    rng = random.Random(seed)
    total, window = [(12, None), (8, 40)][seed % 2]
    tables = BlockTables(PagePool(total), 16, window)
    s = Scheduler(SchedulerConfig(total_pages=total, max_running=8, max_num_batched_tokens=48, prefill_chunk=32),
                  tables.max_pages)
    reqs = [req(f"r{i}", rng.randint(1, 100), rng.randint(1, 60), k=rng.choice([0, 0, 3])) for i in range(30)]
    for r in reqs:
        s.add(r)
    for _ in range(5000):
        for r in admit_local(s):
            pass
        plan = s.plan()
        for r in plan.preempted:
            if r.seq in tables:  # (preempted before its first chunk ran: no pages yet)
                tables.free(r.seq)
        for c in plan.replays + plan.chunks:
            if c.req.seq not in tables:
                tables.add(c.req.seq)
            tables.release_outside_window(c.req.seq)
            tables.append([(c.req.seq, c.end - c.start)])  # raises OutOfPages if a reservation lied
        outs = []
        for r in plan.decode:
            n = 1 + min(s.lookahead(r), r.params.max_tokens - r.generated - 1, 0 if r.spec is None else 3)
            tables.release_outside_window(r.seq)
            before = tables.length(r.seq)
            tables.append([(r.seq, n)])
            kept = rng.randint(1, n)
            tables.truncate(r.seq, before + kept)
            outs.append([5] * kept)
        for r, o in zip(plan.decode, s.update(plan, outs)):
            pass
        run_prefill(s, plan)
        for r in reqs:
            if r.finish_reason is not None and r.request_id in s.running:  # the engine releases them
                s.finish(r)
                if r.seq in tables:
                    tables.free(r.seq)
        assert sum(len(tables.live_pages(r.seq)) for r in reqs if r.seq in tables) <= s.reserved <= total
        if all(r.status is RequestStatus.FINISHED for r in reqs):
            break
    assert all(r.generated == r.params.max_tokens for r in reqs)
    assert s.num_preemptions > 0 and s.reserved == 0


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


def test_n_choices_reserve_for_each_and_split_the_reservation_at_the_fork():
    s = make(total=20)
    parent = Request("p", next(_seq), [1] * 40, SamplingParams(max_tokens=30, n=3), frozenset())
    s.add(parent)  # 40 + 30 tokens: 5 pages a choice, 15 <= 20
    assert admit_local(s) == [parent] and s.reserved == 3 * 3  # prompt + first token, for each choice
    run_prefill(s, s.plan())
    children = [Request(f"p#{i}", next(_seq), parent.prompt, parent.params.for_choice(i), frozenset(),
                        status=RequestStatus.PREFILLING, choice=i) for i in (1, 2)]
    parent.params = parent.params.for_choice(0)  # as EngineCore.fork leaves it
    s.start(parent, 5)
    s.start(children[0], 5)
    s.start(children[1], 5)
    children[1].finish_reason = FinishReason.STOP  # ended with its first token: its share goes back
    s.adopt(parent, children)
    assert (parent.reserved_pages, children[0].reserved_pages, s.reserved) == (3, 3, 6)
    assert list(s.running) == ["p", "p#1"]
    assert [r.request_id for r in s.plan().decode] == ["p", "p#1"] and s.reserved == 6  # nothing to grow yet
    with pytest.raises(ResourceExhausted, match="for each of n=5 choices"):
        s.add(Request("q", next(_seq), [1] * 40, SamplingParams(max_tokens=30, n=5), frozenset()))  # 25 > 20


def test_prompt_chunks_beside_decoding_requests_keep_to_the_time_budget_or_the_arrivals():
    asked = []

    def budget(batch):  # the engine's: prompt tokens a step of `batch` decoding requests may add
        asked.append(batch)
        return 40

    tables = BlockTables(PagePool(100), 16)
    s = Scheduler(SchedulerConfig(total_pages=100, max_num_batched_tokens=512, prefill_chunk=16), tables.max_pages,
                  budget)
    d = req("d", 4, 50)
    s.add(d)
    admit_local(s)
    plan = s.plan()
    assert [x.end for x in plan.chunks] == [4] and asked == []  # nothing decodes: only the token budget
    run_prefill(s, plan)
    for r in (req("a", 100, 4), req("b", 20, 4)):
        s.add(r)
    admit_local(s)
    plan = s.plan()  # 120 prompt tokens to compute: a quarter is 30, under the budget's 40
    assert asked == [1] and [(x.req.request_id, x.start, x.end) for x in plan.chunks] == [("a", 0, 16), ("a", 16, 32)]
    s2 = Scheduler(SchedulerConfig(total_pages=100, max_num_batched_tokens=512, prefill_chunk=16), tables.max_pages,
                   lambda batch: 8)
    s2.add(req("e", 4, 50))
    admit_local(s2)
    run_prefill(s2, s2.plan())
    s2.add(req("f", 300, 4))
    admit_local(s2)  # 300 tokens to compute: a quarter is 75, over the time budget's 8
    assert [x.end for x in s2.plan().chunks] == [16, 32, 48, 64]
