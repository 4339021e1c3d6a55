"""Prefill runner: the prompt's forward pass into FP8 pages, announcing each layer as it completes.

Runs in one worker thread (one forward at a time: on a CPU two would only share the cores).
``on_layer(layer)`` is called from that thread the moment a layer's pages are complete, so the
server can ship them while later layers compute; setting ``abort`` stops the forward at its next
layer (the stream was cancelled).
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import torch

from kvwire.errors import InvalidArgument, ResourceExhausted
from kvwire.kv.pool import OutOfPages
from kvwire.runtime import Engine


class Aborted(Exception):
    """The stream was cancelled: stop computing."""


class _LayerHook:
    """A KVCache wrapper that reports each layer after the real cache wrote its pages."""

    def __init__(self, cache, on_layer: Callable[[int], None], abort: threading.Event):
        self.cache, self.on_layer, self.abort = cache, on_layer, abort

    def attend(self, layer, q, k, v, window):
        out = self.cache.attend(layer, q, k, v, window)
        if self.abort.is_set():
            raise Aborted()
        self.on_layer(layer)
        return out


class PrefillRunner:
    def __init__(self, engine: Engine, num_pages: int):
        self.engine = engine
        self.cache = engine.new_cache(num_pages)
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards the page pool between the worker and the event loop

    def validate(self, tokens: list[int]) -> None:
        cfg = self.engine.model_config
        if not tokens:
            raise InvalidArgument("token_ids is empty: a prefill needs at least one prompt token")
        if len(tokens) > cfg.max_position_embeddings:
            raise InvalidArgument(f"the prompt has {len(tokens)} tokens; the model's context is "
                                  f"{cfg.max_position_embeddings}")
        bad = [t for t in tokens if not 0 <= t < cfg.vocab_size]
        if bad:
            raise InvalidArgument(f"token ids {bad[:5]} are outside the vocabulary [0, {cfg.vocab_size})")

    def new_sequence(self) -> int:
        return next(self._ids)

    def forward(self, seq: int, tokens: list[int], on_layer: Callable[[int], None],
                abort: threading.Event) -> torch.Tensor:
        """Allocate ``seq``'s pages and run the prompt; returns the last position's logits [vocab].

        On success the caller owns the sequence and must ``release`` it; on failure (including
        an abort from ``on_layer``) its pages are already back in the pool.
        """
        if abort.is_set():
            raise Aborted()
        with self._lock:
            try:
                positions = self.cache.prepare([seq], [len(tokens)])
            except OutOfPages as e:
                self.cache.reset(seq)
                raise ResourceExhausted(f"prefill KV pool is full ({e}); retry later") from e
        try:
            logits = self.engine.model(torch.tensor(tokens), positions, _LayerHook(self.cache, on_layer, abort),
                                       logits_rows=torch.tensor([len(tokens) - 1]))
        except BaseException:
            self.release(seq)
            raise
        return logits[0]

    def warm_up(self) -> None:
        """One short forward, so the first request doesn't pay for lazy initialisation."""
        seq = self.new_sequence()
        self.forward(seq, [0] * 8, lambda layer: None, threading.Event())
        self.release(seq)

    def layer_pages(self, seq: int, layer: int):
        """(k, v, k_scale, v_scale) of one sequence and layer, in page order (copies)."""
        with self._lock:
            idx = torch.tensor(self.cache.page_ids(seq))
        k, v, ks, vs = self.cache.layer_tensors(layer)
        pick = lambda t: t.view(torch.uint8)[idx].view(t.dtype)  # noqa: E731  (uint8 views: plain byte copies)
        return pick(k), pick(v), None if ks is None else ks[idx], None if vs is None else vs[idx]

    def release(self, seq: int) -> None:
        with self._lock:
            self.cache.reset(seq)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self.cache.stats()
