"""The served path's own costs: a lagging reader gets merged messages, a KV pull imports in few runner calls."""
from __future__ import annotations

import asyncio

from kvwire.engine.async_engine import merge_queued
from kvwire.engine.request import RequestOutput
from kvwire.sampling_params import FinishReason, KVSourceChoice, SamplingParams, TokenLogprobs
from protos.kvwire.v1 import kvwire_pb2 as pb
from tests.decode_svc.harness import Harness


def _queue(*items) -> asyncio.Queue:
    q = asyncio.Queue()
    for item in items:
        q.put_nowait(item)
    return q


async def test_merge_keeps_every_token_in_order_and_the_last_finish_reason():
    q = _queue(RequestOutput("r", [3]), RequestOutput("r", [4, 5]), RequestOutput("r", [6], FinishReason.LENGTH))
    merged, failure = merge_queued(RequestOutput("r", [1, 2]), q)
    assert (merged.token_ids, merged.finish_reason, failure) == ([1, 2, 3, 4, 5, 6], FinishReason.LENGTH, None)
    assert q.empty()
    lp = [TokenLogprobs(t, -0.1 * t) for t in range(4)]
    q = _queue(RequestOutput("r", [2, 3], None, lp[2:]))
    merged, _ = merge_queued(RequestOutput("r", [0, 1], None, lp[:2]), q)
    assert merged.token_ids == [0, 1, 2, 3] and merged.logprobs == lp  # logprobs stay beside their tokens


async def test_merge_stops_at_the_finish_and_hands_back_a_failure_after_the_tokens():
    done = RequestOutput("r", [2], FinishReason.STOP)
    q = _queue(done, RequestOutput("r", [9]))
    merged, _ = merge_queued(RequestOutput("r", [1]), q)
    assert (merged.token_ids, merged.finish_reason, q.qsize()) == ([1, 2], FinishReason.STOP, 1)  # nothing past it

    boom = RuntimeError("step failed")
    merged, failure = merge_queued(RequestOutput("r", [1]), _queue(RequestOutput("r", [2]), boom))
    assert (merged.token_ids, failure) == ([1, 2], boom)
    assert merge_queued(boom, _queue()) == (None, boom)

    alone = RequestOutput("r", [7])
    assert merge_queued(alone, _queue())[0] is alone  # nothing queued: passed through, not copied


async def test_a_reader_that_falls_behind_gets_the_same_tokens_in_fewer_messages(cfg):
    prompt, params = list(range(5, 40)), SamplingParams(max_tokens=12, ignore_eos=True)
    async with Harness(cfg) as h:
        steady = [out.token_ids async for out in h.engine.generate(prompt, params, "steady")]
        assert [len(t) for t in steady] == [1] * 12  # a reader that keeps up: one token per message

        stream = h.engine.generate(prompt, params, "lagging")
        first = await anext(stream)
        req = h.engine.core.requests["lagging"]
        while not req.finished:  # the reader stops reading while the engine finishes the request
            await asyncio.sleep(0.01)
        rest = [out async for out in stream]
    assert len(rest) == 1 and rest[0].finished  # eleven steps' tokens in one message
    assert first.token_ids + rest[0].token_ids == [t for ts in steady for t in ts]


async def test_a_kv_pull_imports_in_two_runner_calls_whatever_its_chunks(cfg):
    prompt = list(range(5, 105))
    async with Harness(cfg) as h:
        expected = await h.generate(prompt, kv_source=pb.KV_SOURCE_LOCAL, max_tokens=8, ignore_eos=True)
        calls = []
        run = h.engine.run

        async def counted(fn, *args):
            if fn.__name__ != "execute":  # the decode steps that follow
                calls.append(fn.__name__)
            return await run(fn, *args)

        h.engine.run = counted
        stream = h.engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True), "pull",
                                   KVSourceChoice.REMOTE)
        tokens = [t async for out in stream for t in out.token_ids]
        assert calls == ["begin", "finish"], calls  # not one per layer's chunk
        assert tokens == expected

        # A pull larger than the import bound flushes as it goes: a call per chunk here, same tokens.
        h.engine.sources.remote.import_batch_bytes = 1
        calls.clear()
        tokens = [t async for out in h.engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True),
                                                       "small", KVSourceChoice.REMOTE) for t in out.token_ids]
        assert calls == ["begin"] + ["copy"] * h.engine.runtime.spec.num_layers + ["finish"], calls
        assert tokens == expected
        assert await h.pools_back_to(64, 128)
