"""Prefix caching: page names, refcounts and LRU eviction, reuse in the engine and across the split."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from kvwire import LLM, SamplingParams
from kvwire.config import KVDtype
from kvwire.engine.prefix_cache import PrefixCache, page_hashes
from kvwire.kv.pool import BlockTables, OutOfPages, PagePool
from kvwire.runtime import EngineConfig
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from tests.decode_svc.harness import Harness, tiny_model
from tests.decode_svc.test_engine import ControlledPrefill


def test_page_names_chain_tokens_and_salt():
    toks = list(range(50))
    a = page_hashes(toks, 16, b"model-a")
    assert len(a) == 3 and a == page_hashes(toks[:48] + [7, 7], 16, b"model-a")  # partial page: unnamed
    changed = page_hashes([999] + toks[1:], 16, b"model-a")
    assert all(x != y for x, y in zip(a, changed))  # a name fixes the whole prefix before it
    assert page_hashes(toks, 16, b"model-b")[0] != a[0]
    assert page_hashes(toks[:32] + [1] * 16, 16, b"model-a")[:2] == a[:2]


def _cache(num_pages=8):
    pool = PagePool(num_pages)
    tables = BlockTables(pool, 4)
    return pool, tables, PrefixCache(pool, 4, b"s")


def test_eviction_never_frees_a_page_in_use():
    pool, tables, cache = _cache(8)
    prompt = list(range(13))  # 3 full pages + 1 token
    tables.add(0)
    tables.append([(0, 13)])
    cache.remember(tables, 0, prompt)
    assert len(cache) == 3 and pool.num_used == 4
    assert cache.attach(tables, 1, prompt) == 3  # a second sequence reads the cached prefix
    tables.free(0)  # the first one ends (or is cancelled): the prefix stays, held twice
    assert pool.num_used == 3 and [pool.refcount(p) for p in tables.table(1)] == [2, 2, 2]
    with pytest.raises(OutOfPages):
        pool.allocate(6)  # 5 free; nothing evictable: sequence 1 holds every cached page
    assert len(cache) == 3 and pool.num_used == 3
    tables.free(1)
    assert len(pool.allocate(6)) == 6 and len(cache) == 2  # one cached page made room: the chain's last
    assert len(cache.match(page_hashes(prompt, 4, b"s"))) == 2


def test_lru_keeps_recently_used_chains():
    pool, tables, cache = _cache(12)
    for seq, base in ((0, 100), (1, 200)):
        tables.add(seq)
        tables.append([(seq, 9)])
        cache.remember(tables, seq, [base + i for i in range(9)])
        tables.free(seq)
    assert len(cache) == 4 and pool.num_free == 8
    cache.match(page_hashes([100 + i for i in range(8)], 4, b"s"))  # chain 100 used again
    pool.allocate(10)  # two pages must go: chain 200's
    assert cache.match(page_hashes([100 + i for i in range(8)], 4, b"s")) != []
    assert cache.match(page_hashes([200 + i for i in range(8)], 4, b"s")) == []


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny"))


def test_llm_reuses_a_cached_prefix(model_dir):
    llm = LLM(model_dir, num_pages=64, kv_dtype="bf16", prefix_caching=True)
    system = list(range(10, 58))  # 48 tokens: 3 pages
    first = llm.add_request(system + [5, 6, 7], SamplingParams(max_tokens=4))
    req1 = llm.core.requests[first]
    while llm.has_unfinished():
        llm.step()
    second = llm.add_request(system + [8, 9], SamplingParams(max_tokens=4))
    req2 = llm.core.requests[second]
    while llm.has_unfinished():
        llm.step()
    assert req1.cached_tokens == 0 and req2.cached_tokens == 48
    # The reused pages give the suffix the same logits as computing the prompt whole (bf16 pages).
    runner = llm.core.runner
    hit, miss = 10**6, 10**6 + 1
    runner.reuse_prefix(hit, system + [8, 9])
    with torch.no_grad():
        a, b = runner.prefill(hit, system + [8, 9]), None
        runner.prefix, saved = None, runner.prefix
        b = runner.prefill(miss, system + [8, 9])
        runner.prefix = saved
    runner.free(hit)
    runner.free(miss)
    torch.testing.assert_close(a, b, atol=2e-2, rtol=0)
    assert llm.stats()["used"] == llm.stats()["cached_pages"] == 3


class CountingPrefill(ControlledPrefill):
    """Counts the KV pages each stream sends (over all layers)."""

    def __init__(self, inner, **kw):
        super().__init__(inner, **kw)
        self.pages: list[int] = []

    async def Prefill(self, request, context):
        self.pages.append(0)
        async for msg in super().Prefill(request, context):
            if msg.WhichOneof("kind") == "chunk":
                self.pages[-1] += msg.chunk.num_pages
            yield msg


async def test_decode_asks_prefill_only_for_missing_pages(model_dir):
    cfg = EngineConfig(model_dir=model_dir, num_pages=128, kv_dtype=KVDtype.FP8_E4M3)
    holder = {}

    def wrap(inner):
        holder["w"] = CountingPrefill(inner)
        return holder["w"]

    system = list(range(10, 74))  # 64 tokens: 4 pages
    async with Harness(cfg, prefill_wrapper=wrap, prefix_caching=True) as h:
        layers = h.engine.runtime.spec.num_layers
        await h.generate(system + [5, 6, 7], max_tokens=4)  # miss: 5 pages of each layer
        await h.generate(system + [8, 9, 10, 11, 12], max_tokens=4)  # hit: only page 4 is new
        assert holder["w"].pages == [5 * layers, 1 * layers]
        assert h.engine.stats()["cached_pages"] == 4
        assert h.prefill_runner.prefix.hits == 4  # prefill computed only the 5 new tokens too
        # A name that does not match the tokens is refused, not trusted.
        stub = pbg.PrefillServiceStub(h.channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Prefill(pb.PrefillRequest(token_ids=system + [1, 2], cached_pages=2,
                                                          cached_prefix_hash=b"\0" * 32)):
                pass
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "cached_prefix_hash" in e.value.details()
        # A forced local prefill reuses the same pages; the outputs stay well-formed.
        out = await h.generate(system + [8, 9], max_tokens=6, kv_source=pb.KV_SOURCE_LOCAL)
        assert len(out) == 6
        assert await h.pools_back_to(64 - 4, 128 - 4)  # only the cached prefix remains held


async def test_cancel_during_transfer_with_a_cached_prefix_frees_only_the_request(model_dir):
    cfg = EngineConfig(model_dir=model_dir, num_pages=128)
    holder = {}

    def wrap(inner):
        holder["w"] = ControlledPrefill(inner, pause=False)
        return holder["w"]

    system = list(range(10, 74))
    async with Harness(cfg, prefill_wrapper=wrap, prefix_caching=True) as h:
        await h.generate(system + [1], max_tokens=2)
        holder["w"].pause, holder["w"].chunk_sent = True, asyncio.Event()
        call = h.decode.GenerateTokens(pb.GenerateTokensRequest(prompt_token_ids=system + list(range(100, 140)),
                                                                sampling=pb.SamplingParams(max_tokens=50)))
        reader = asyncio.ensure_future(call.read())
        await asyncio.wait_for(holder["w"].chunk_sent.wait(), 10)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        holder["w"].resume.set()
        # prefill's forward may have finished before it saw the cancel: its full pages are then
        # cached too (valid KV), so its pool is back to "everything but the cache".
        for _ in range(200):
            p = h.prefill_runner.stats()
            if p["free"] == 128 - p["cached_pages"] and h.engine.stats()["free"] == 64 - 4:
                break
            await asyncio.sleep(0.05)
        assert h.engine.stats()["free"] == 64 - 4 and h.engine.stats()["cached_pages"] == 4
        assert p["free"] == 128 - p["cached_pages"] and p["cached_pages"] in (4, 6)
