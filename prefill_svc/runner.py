"""Prefill runner: the prompt's forward pass into FP8 pages, announcing each layer as it completes.

Runs in one worker thread (one forward at a time: on a CPU two would only share the cores).
``on_layer(layer)`` is called from that thread the moment a layer's pages are complete, so the
server can ship them while later layers compute; setting ``abort`` stops the forward at its next
layer (the stream was cancelled). With a ``CoreShare`` (``--share-cores``) the forward computes on
every usable core while a co-located decode is idle, and checks again before each layer.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import torch

from kvwire_serving.cores import CoreShare, use_threads
from kvwire.engine.prefix_cache import PrefixCache, cache_salt
from kvwire.errors import ResourceExhausted, never_fits
from kvwire.kv.pool import OutOfPages
from kvwire.runtime import Runtime


class Aborted(Exception):
    """The stream was cancelled: stop computing."""


class _LayerHook:
    """A KVCache wrapper that reports each layer after the real cache wrote its pages (and,
    lent cores, sets the next layer's thread count)."""

    def __init__(self, cache, on_layer: Callable[[int], None], abort: threading.Event,
                 cores: CoreShare | None = None):
        self.cache, self.on_layer, self.abort, self.cores = cache, on_layer, abort, cores

    def attend(self, layer, q, k, v, window):
        out = self.cache.attend(layer, q, k, v, window)
        self.after_layer(layer)
        return out

    def after_layer(self, layer: int) -> int:
        """``layer``'s pages are written (by ``attend``, or by the fused prefill of kvwire.model.fast_decode):
        report it; returns the thread count for the next layer."""
        if self.abort.is_set():
            raise Aborted()
        self.on_layer(layer)
        if self.cores is not None:
            use_threads(self.cores.busy())
        return torch.get_num_threads()

    def __getattr__(self, name):  # the rest is the real cache's (the fused prefill reads its pages and step)
        return getattr(self.cache, name)


class PrefillRunner:
    def __init__(self, runtime: Runtime, num_pages: int, prefix_caching: bool = False,
                 cores: CoreShare | None = None):
        self.runtime, self.cores = runtime, cores
        self.cache = runtime.new_cache(num_pages)
        self.salt = cache_salt(runtime.fingerprint, runtime.spec)
        # Reused pages are read, never rewritten; not with a sliding window (pages are given back).
        self.prefix = PrefixCache(self.cache.pool, runtime.spec.block_size, self.salt) \
            if prefix_caching and self.cache.tables.window is None else None
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards the page pool between the worker and the event loop
        self._queued = 0  # forwards announced by ``expect`` and not started yet

    def check_fits(self, num_tokens: int) -> None:
        """NeverFits when a prompt of ``num_tokens`` tokens needs more pages than the whole pool
        (a full pool later is ResourceExhausted, "retry later", from ``forward``)."""
        need = self.cache.tables.max_pages(num_tokens, num_tokens, 0)
        if need > self.cache.pool.num_pages:
            raise never_fits(f"prompt ({num_tokens} tokens) needs {need} KV pages but the prefill pool has "
                             f"{self.cache.pool.num_pages}", fix="shorten the prompt")

    def expect(self) -> None:
        """A forward is being queued: lent cores stay marked busy from the one running to it, so a
        co-located decode does not take every core for a step in the gap between two prompts."""
        with self._lock:
            self._queued += 1

    def new_sequence(self) -> int:
        return next(self._ids)

    def forward(self, seq: int, tokens: list[int], on_layer: Callable[[int], None],
                abort: threading.Event) -> torch.Tensor:
        """Allocate ``seq``'s pages and run the prompt; returns the last position's logits [vocab].

        On success the caller owns the sequence and must ``release`` it; on failure (including
        an abort from ``on_layer``) its pages are already back in the pool.
        """
        with self._lock:
            self._queued = max(0, self._queued - 1)
        try:
            if abort.is_set():
                raise Aborted()
            with self._lock:
                try:
                    start = 0
                    if self.prefix is not None:  # a cached prefix is attached, only the rest computed
                        start = self.prefix.attach(self.cache.tables, seq, tokens) * self.runtime.spec.block_size
                    positions = self.cache.prepare([seq], [len(tokens) - start], prefill=True)
                except OutOfPages as e:
                    self.cache.reset(seq)
                    raise ResourceExhausted(f"the prefill KV pool is full of other prompts ({e}); retry later") from e
            try:
                if self.cores is not None:
                    use_threads(self.cores.busy())
                # after a cached prefix: its pages dequantized, the rest at full precision (PagedKVCache)
                logits = self.runtime.model(torch.tensor(tokens[start:]), positions,
                                            _LayerHook(self.cache, on_layer, abort, self.cores),
                                            logits_rows=torch.tensor([len(tokens) - start - 1]))
            except BaseException:
                self.release(seq)
                raise
        finally:  # this forward is over, whichever way: idle unless another prompt is queued
            if self.cores is not None and not self._queued:
                self.cores.idle()
        if self.prefix is not None:
            with self._lock:
                self.prefix.remember(self.cache.tables, seq, tokens)
        return logits[0]

    def warm_up(self) -> None:
        """One short forward, so the first request doesn't pay for lazy initialisation."""
        seq = self.new_sequence()
        self.forward(seq, [0] * 8, lambda layer: None, threading.Event())
        self.release(seq)

    def layer_pages(self, seq: int, layer: int, first_page: int = 0):
        """(k, v, k_scale, v_scale) of one sequence and layer, pages first_page.. in order (copies)."""
        with self._lock:
            idx = torch.tensor(self.cache.page_ids(seq)[first_page:])
        k, v, ks, vs = self.cache.layer_tensors(layer)
        pick = lambda t: t.view(torch.uint8)[idx].view(t.dtype)  # noqa: E731  (uint8 views: plain byte copies)
        return pick(k), pick(v), None if ks is None else ks[idx], None if vs is None else vs[idx]

    def release(self, seq: int) -> None:
        with self._lock:
            self.cache.reset(seq)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.cache.stats(), "cached_pages": len(self.prefix) if self.prefix is not None else 0}
