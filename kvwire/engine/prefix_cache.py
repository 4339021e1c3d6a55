"""Prefix caching: full KV pages named by a hash chain, shared by reference, evicted LRU.

A full page is named by ``sha256(previous page's name || salt || its token ids)`` (little-endian
uint32 ids; the first page chains from ``sha256(salt)``), where the salt is the model fingerprint
and page spec, so a name fixes the page's whole prefix and the model that computed it. Never
Python's ``hash()``: the names must agree across processes (decode and prefill compare them).

The cache holds one reference on each page it names (``PagePool.share``); a sequence that reuses
a cached prefix holds its own. Eviction (LRU, when the pool runs short) drops only pages whose
single holder is the cache, so cancellation or eviction never frees a page a sequence still
reads. Only full prompt pages are cached: they never change once written.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np

from kvwire.kv.pool import BlockTables, PagePool


def page_hashes(tokens: Sequence[int], block_size: int, salt: bytes) -> list[bytes]:
    """The names of the full pages of ``tokens`` (len(tokens) // block_size of them)."""
    ids = np.asarray(tokens, dtype="<u4")
    prev, out = hashlib.sha256(salt).digest(), []
    for i in range(len(ids) // block_size):
        prev = hashlib.sha256(prev + salt + ids[i * block_size:(i + 1) * block_size].tobytes()).digest()
        out.append(prev)
    return out


def cache_salt(fingerprint, spec) -> bytes:
    """What a page name commits to besides its tokens: the model (not its directory name) and the
    page layout. Decode and prefill derive the same salt exactly when they may exchange KV."""
    fp = {k: v for k, v in asdict(fingerprint).items() if k != "model_name"}
    return json.dumps({"fingerprint": fp, "spec": spec.to_dict()}, sort_keys=True).encode()


def reusable_pages(num_tokens: int, block_size: int) -> int:
    """Full prompt pages a new sequence may take from the cache: the prompt's last token is always
    computed, since its logits give the first generated token."""
    return max(0, num_tokens - 1) // block_size


class PrefixCache:
    def __init__(self, pool: PagePool, block_size: int, salt: bytes):
        self.pool, self.block_size, self.salt = pool, block_size, salt
        self._pages: OrderedDict[bytes, int] = OrderedDict()  # name -> page id, least recently used first
        self.hits = self.misses = 0  # pages, over all lookups
        pool.reclaim = self.evict

    def __len__(self) -> int:
        return len(self._pages)

    def names(self, tokens: Sequence[int]) -> list[bytes]:
        return page_hashes(tokens, self.block_size, self.salt)

    def attach(self, tables: BlockTables, seq: int, prompt: Sequence[int]) -> int:
        """Start ``seq`` on the cached pages of ``prompt``'s longest cached prefix (never its last
        token's page); returns how many pages it took (0: ``seq`` is not created)."""
        pages = self.match(self.names(prompt[:reusable_pages(len(prompt), self.block_size) * self.block_size]))
        if pages:
            tables.attach(seq, pages)
        return len(pages)

    def remember(self, tables: BlockTables, seq: int, prompt: Sequence[int]) -> None:
        """Name ``seq``'s full prompt pages (call once its prompt KV is complete)."""
        names = self.names(prompt)
        self.insert(names, tables.table(seq)[:len(names)])

    def match(self, names: Sequence[bytes]) -> list[int]:
        """Page ids of the longest cached run of ``names`` from the start (marked recently used).
        The caller takes its own reference (``BlockTables.attach``) before anything can evict them."""
        pages = []
        for name in names:
            page = self._pages.get(name)
            if page is None:
                break
            pages.append(page)
        self._touch(names[:len(pages)])
        self.hits += len(pages)
        self.misses += len(names) - len(pages)
        return pages

    def insert(self, names: Sequence[bytes], pages: Sequence[int]) -> None:
        """Name full, final pages (a sequence's prompt pages, in order); already named ones stay."""
        for name, page in zip(names, pages):
            if name not in self._pages:
                self.pool.share([page])
                self._pages[name] = page
        self._touch(names[:len(pages)])

    def _touch(self, names: Sequence[bytes]) -> None:
        # Deepest page first, so a chain's first pages are the most recent: eviction takes a
        # chain from its end and never leaves later pages unreachable behind an evicted one.
        for name in reversed(names):
            self._pages.move_to_end(name)

    def evict(self, n: int) -> int:
        """Give back up to ``n`` pages no sequence holds (least recently used first)."""
        gone = [name for name, page in self._pages.items() if self.pool.refcount(page) == 1][:n]
        for name in gone:
            self.pool.free([self._pages.pop(name)])
        return len(gone)

    def clear(self) -> None:
        self.evict(len(self._pages))
