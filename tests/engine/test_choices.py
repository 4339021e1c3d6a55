"""n > 1 choices through the in-process engine: one prefill, then a fork on shared KV pages.

The fork shares the prompt's full pages (reference counts) and copies the partial last page (the
same bytes, FP8 scales included); n = 4 holds about one prompt plus four answers; each choice has
its own seed stream (seed + i), greedy choices are n = 1's output; preemption, cancellation and
the prefix cache leave nothing behind.
"""
from __future__ import annotations

import pytest

from kvwire import LLM, SamplingParams
from kvwire.errors import InvalidRequest, ResourceExhausted
from kvwire.sampling_params import FinishReason
from tests.decode_svc.harness import tiny_model

PROMPT = [(j * 7) % 200 + 3 for j in range(70)]  # 4 full pages of 16 and a partial one


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, num_pages=128)  # fp8 KV with per-token scales


def tokens(outs):
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("length", [70, 64])
def test_fork_shares_full_pages_and_copies_the_partial_one(llm, length):
    runner, cache = llm.core.runner, llm.core.runner.cache
    assert cache.k_scale is not None  # the copy must carry the scales too
    runner.prefill(1000, PROMPT[:length])
    try:
        runner.fork(1000, [1001, 1002])
        parent = cache.page_ids(1000)
        full = length // 16
        for child in (1001, 1002):
            table = cache.page_ids(child)
            assert cache.length(child) == length and table[:full] == parent[:full]
            if length % 16:  # copy on write: a page of its own with the same bytes
                assert table[full] != parent[full] and cache.tables.pool.refcount(table[full]) == 1
                for t in cache._tensors():
                    assert t[:, table[full]].equal(t[:, parent[full]])
        assert all(cache.tables.pool.refcount(p) == 3 for p in parent[:full])
        assert cache.stats()["used"] == len(parent) + (2 if length % 16 else 0)
        assert cache.stats()["shared"] == full
        # each appends on its own: the parent's next token does not reach a child's page
        runner.step([1000, 1001], [[5], [6]])
        assert cache.page_ids(1001)[:full] == parent[:full]
    finally:
        for seq in (1000, 1001, 1002):
            runner.free(seq)
    assert cache.stats()["used"] == 0


def test_greedy_choices_are_the_n1_output(llm):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    one = llm.generate(PROMPT, params)[0]
    outs = llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, n=3))
    assert [o.index for o in outs] == [0, 1, 2] and len({o.request_id for o in outs}) == 3
    assert tokens(outs) == [one.token_ids] * 3
    assert all(o.finish_reason is FinishReason.LENGTH for o in outs)
    assert llm.stats()["used"] == 0 and llm.stats()["reserved_pages"] == 0 and not llm.has_unfinished()


def test_seeded_choices_reproduce_and_differ_each_on_its_own_stream(llm):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=4, logprobs=2)
    a, b = llm.generate(PROMPT, params), llm.generate(PROMPT, params)
    assert tokens(a) == tokens(b)
    assert len({tuple(t) for t in tokens(a)}) == 4  # different choices differ
    for i, out in enumerate(a):  # the rule: choice i samples with seed + i, as n = 1 would
        alone = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=1.0, seed=7 + i, logprobs=2))[0]
        assert out.token_ids == alone.token_ids and out.logprobs == alone.logprobs
    unseeded = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=1.0, n=4))
    assert len({tuple(t) for t in tokens(unseeded)}) > 1


def test_n4_holds_one_prompt_and_four_answers(model_dir):
    llm = LLM(model_dir, num_pages=128)
    answer = 20  # 70 + 20 tokens: 6 pages a sequence, the first 4 full prompt pages shared
    peak, shared = 0, 0
    for _ in llm.stream(PROMPT, SamplingParams(max_tokens=answer, ignore_eos=True, n=4)):
        peak, shared = max(peak, llm.stats()["used"]), max(shared, llm.stats()["shared"])
    prompt_pages, own = 4, 6 - 4
    assert peak == prompt_pages + 4 * own < 4 * 6  # 12 pages, not 24
    assert shared == prompt_pages
    assert llm.stats()["used"] == 0 and llm.stats()["reserved_pages"] == 0


def test_a_choice_that_stops_early_ends_with_its_own_finish_reason(llm):
    stop = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2))
    first_of_1 = stop[1].token_ids[2]  # choice 1 stops at its third token, choice 0 runs on
    outs = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2,
                                               stop_token_ids=(first_of_1,)))
    assert outs[1].token_ids == stop[1].token_ids[:3] and outs[1].finish_reason is FinishReason.STOP
    assert llm.stats()["used"] == 0


def test_cancelling_mid_stream_frees_every_choice(llm):
    stream = llm.stream(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, n=4))
    seen = {next(stream).index for _ in range(6)}
    assert llm.stats()["used"] > 0 and len(seen) > 1
    stream.close()
    assert llm.stats()["used"] == 0 and llm.stats()["reserved_pages"] == 0 and not llm.has_unfinished()


def test_preempted_choices_recompute_to_the_same_tokens(model_dir):
    """16 pages: the n = 3 request (5 pages a choice at most) and a second one are admitted, then
    outgrow the pool; choices are preempted and recomputed on their own, and end as with room."""
    prompts = [PROMPT[:35], PROMPT[:20]]
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.9, seed=11, n=3),
              SamplingParams(max_tokens=40, ignore_eos=True)]
    roomy = tokens(LLM(model_dir, num_pages=128).generate(prompts, params))
    tight = LLM(model_dir, num_pages=16)
    assert tokens(tight.generate(prompts, params)) == roomy
    assert tight.stats()["num_preemptions"] > 0
    assert tight.stats()["used"] == 0 and tight.stats()["reserved_pages"] == 0


def test_prefix_cache_pages_are_shared_by_choices_and_kept(model_dir):
    llm = LLM(model_dir, num_pages=128, prefix_caching=True)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3)
    first, again = llm.generate(PROMPT, params), llm.generate(PROMPT, params)
    assert tokens(first) == tokens(again)
    assert llm.stats()["used"] == llm.stats()["cached_pages"] == 4  # only the cache holds pages


def test_n_out_of_range_or_past_the_pool_is_refused(llm, model_dir):
    with pytest.raises(InvalidRequest, match="n must be in"):
        llm.generate(PROMPT, SamplingParams(n=0))
    with pytest.raises(InvalidRequest, match="n must be in"):
        llm.generate(PROMPT, SamplingParams(n=17))
    small = LLM(model_dir, num_pages=16)
    with pytest.raises(ResourceExhausted, match="each of n=4 choices"):
        small.generate(PROMPT, SamplingParams(max_tokens=20, n=4))  # 6 pages each, 24 > 16
    assert small.stats()["used"] == 0
