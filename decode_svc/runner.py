"""Decode runner: the tensor side of decode_svc (no asyncio, no gRPC).

Owns the paged KV cache. Sequences arrive with their prompt KV imported page by page from the
wire (``import_begin`` / ``import_chunk``), then advance together: one ``step`` runs one batched
forward for every decoding sequence. Not thread-safe by design: the engine makes every call from
one worker thread, in submission order, so a sequence is never freed under a step or an import.
"""
from __future__ import annotations

import torch

from core.kv.wire import DecodedChunk
from core.runtime import Engine


class DecodeRunner:
    def __init__(self, engine: Engine, num_pages: int):
        self.engine = engine
        self.cache = engine.new_cache(num_pages)

    def import_begin(self, seq: int, num_tokens: int) -> list[int]:
        """Allocate pages for a prompt whose KV will arrive over the wire; returns its page ids."""
        self.cache.extend(seq, num_tokens)
        return self.cache.page_ids(seq)

    def import_chunk(self, pages: list[int], chunk: DecodedChunk) -> None:
        """Copy a verified chunk's bytes into the sequence's pages (no re-layout: same spec)."""
        n = chunk.k.shape[0]
        idx = torch.tensor(pages[chunk.first_page:chunk.first_page + n])
        k, v, ks, vs = self.cache.layer_tensors(chunk.layer)
        k.view(torch.uint8)[idx] = chunk.k.view(torch.uint8)  # fp8 has no CPU index_put kernel
        v.view(torch.uint8)[idx] = chunk.v.view(torch.uint8)
        if ks is not None:
            ks[idx] = chunk.k_scale
            vs[idx] = chunk.v_scale

    def step(self, seqs: list[int], tokens: list[list[int]]) -> list[torch.Tensor]:
        """Feed ``tokens[i]`` (usually one) to ``seqs[i]``; returns each one's logits [n_i, vocab]."""
        flat = [t for ts in tokens for t in ts]
        positions = self.cache.prepare(seqs, [len(ts) for ts in tokens])
        logits = self.engine.model(torch.tensor(flat), positions, self.cache)  # [num_tokens, vocab]
        return list(logits.split([len(ts) for ts in tokens]))

    def warm_up(self) -> None:
        """A short prompt and a few decode steps through the real paths, then forget them."""
        seq = -1
        self.cache.prepare([seq], [8])
        self.engine.model(torch.zeros(8, dtype=torch.int64), torch.arange(8), self.cache)
        for _ in range(2):
            self.step([seq], [[0]])
        self.free(seq)

    def truncate(self, seq: int, length: int) -> None:
        self.cache.truncate(seq, length)

    def free(self, seq: int) -> None:
        self.cache.reset(seq)  # unknown ids are fine: a request may end before its pages existed

    def stats(self) -> dict[str, int]:
        return self.cache.stats()
