"""ModelRunner: the tensor side of the engine (no asyncio, no gRPC).

Owns the paged KV cache. A sequence's prompt KV gets into its pages one of two ways: computed
here (``prefill_chunks``, the local KV source: one forward over chunks of several prompts, each
after what its sequence already holds) or imported page by page from the wire (``import_begin`` /
``import_chunk``, the remote one); then sequences advance together: one ``step`` runs one batched
forward for every decoding sequence, one token each, or several for a speculative verification.
Not thread-safe by design: the engine makes every call from one thread, in submission order, so a
sequence is never freed under a step or an import. Per-sequence state kept beside the runner's (a
speculative draft's, ``kvwire.spec``) is an ``Attachment``: told of every forward's hidden rows,
the warm-up and every free.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Collection, Sequence
from typing import Protocol

import torch

from kvwire.engine.prefix_cache import PrefixCache, cache_salt
from kvwire.engine.step_cost import StepCost
from kvwire.kv.wire import DecodedChunk
from kvwire.runtime import Runtime


class Attachment(Protocol):
    def prefilled(self, seq: int, hidden: torch.Tensor) -> None:
        """``seq``'s prompt was prefilled here; hidden: [hidden], the final normed state of its last position."""

    def stepped(self, seqs: Sequence[int], hidden: Sequence[torch.Tensor]) -> None:
        """A ``step`` fed ``seqs``; hidden[i]: [n_i, hidden], the final normed rows of each one's tokens."""

    def warm_up(self, seq: int) -> None:
        """``warm_up``'s sequence ``seq`` has just stepped: run the attachment's own paths once."""

    def free(self, seq: int) -> None:
        """``seq`` is gone (finished, failed or aborted)."""


class ModelRunner:
    def __init__(self, runtime: Runtime, num_pages: int, prefix_caching: bool = False):
        self.runtime = runtime
        self.cache = runtime.new_cache(num_pages)
        # Not with a sliding window: pages behind it are given back, so a prefix is not kept whole.
        self.prefix = PrefixCache(self.cache.pool, runtime.spec.block_size, cache_salt(runtime.fingerprint, runtime.spec)) \
            if prefix_caching and self.cache.tables.window is None else None
        self.attached: list[Attachment] = []
        # seq -> (its length before, tokens fed) in the last multi-token step: what ``keep`` rolls back
        self._starts: dict[int, tuple[int, int]] = {}
        self.step_cost = StepCost()  # what a step and a prompt token cost here, from this runner's timings
        self.chunk_logits: list[torch.Tensor | None] = []  # the last ``step``'s chunks' results

    @functools.cached_property
    def rows_independent(self) -> bool:
        """Whether every matmul of the model gives a row the same bits whatever the other rows (int8
        weights in the VNNI kernel's packed layout): then prompts are prefilled in one forward and
        each still gets the bits it gets alone. torch's fp32 / bf16 GEMMs pick kernels by shape, so
        there each prompt's chunk has a forward of its own."""
        linears = [m for m in self.runtime.model.modules() if hasattr(m, "in_features")]
        return bool(linears) and all(isinstance(getattr(m, "packed", None), torch.Tensor) for m in linears)

    def attach(self, attachment: Attachment) -> None:
        self.attached.append(attachment)

    def reuse_prefix(self, seq: int, prompt: list[int]) -> int:
        """Attach the longest cached prefix of ``prompt`` to the new sequence ``seq``; returns the
        tokens whose KV is thereby in place (0 without prefix caching or without a hit)."""
        if self.prefix is None:
            return 0
        return self.prefix.attach(self.cache.tables, seq, prompt) * self.runtime.spec.block_size

    def remember_prefix(self, seq: int, prompt: list[int]) -> None:
        """``seq``'s prompt KV is complete: its full pages become reusable."""
        if self.prefix is not None:
            self.prefix.remember(self.cache.tables, seq, prompt)

    def prefill(self, seq: int, tokens: list[int]) -> torch.Tensor:
        """Compute a prompt's KV into new pages of ``seq`` (after a reused prefix, if attached) in one
        forward; returns the last position's logits [vocab]. The same forward prefill_svc runs, so
        the pages hold the same bytes."""
        start = self.cache.length(seq) if seq in self.cache.tables else 0
        [logits] = self.prefill_chunks([(seq, tokens[start:], True)])
        self.remember_prefix(seq, tokens)
        return logits

    def prefill_chunks(self, chunks: Sequence[tuple[int, list[int], bool]],
                       full: Collection[int] = ()) -> list[torch.Tensor | None]:
        """One forward over prompt chunks ``(seq, tokens, last)``: each sequence's tokens follow what
        it already holds (earlier chunks, a reused prefix, or its chunks before this one in the list),
        attending over those pages and causally over themselves (``PagedKVCache.prepare(prefill=True)``:
        the same bits as one forward per chunk); one forward for all where the
        kernels are row-independent, else one each. Returns, per chunk, the logits
        [vocab] of its last token where ``last`` (the prompt is complete: attachments are told),
        else None; for the chunks whose index is in ``full`` (a prompt's logprobs), every row's
        logits [len(tokens), vocab] instead."""
        if len(chunks) > 1 and not self.rows_independent:
            return [out for i, chunk in enumerate(chunks)
                    for out in self.prefill_chunks([chunk], (0,) if i in full else ())]
        t0 = time.perf_counter()
        counts = [len(tokens) for _, tokens, _ in chunks]
        positions = self.cache.prepare([seq for seq, _, _ in chunks], counts, prefill=True)
        picked, spans = self._chunk_rows(chunks, 0, full)
        logits = self.runtime.model(torch.tensor([t for _, tokens, _ in chunks for t in tokens]), positions,
                                    self.cache, logits_rows=torch.tensor(picked, dtype=torch.int64))
        self.step_cost.add_prefill(sum(counts), time.perf_counter() - t0)
        return self._chunk_outputs(chunks, logits, spans, full)

    @staticmethod
    def _chunk_rows(chunks: Sequence[tuple[int, list[int], bool]], row: int, full: Collection[int] = ()
                    ) -> tuple[list[int], list[tuple[int, int]]]:
        """The forward's rows whose logits are computed for ``chunks``, whose tokens start at row
        ``row``: every row of a chunk in ``full``, the last of a chunk that ends its prompt; and per
        chunk (its first index in those rows, how many)."""
        picked: list[int] = []
        spans = []
        for i, (_, tokens, last) in enumerate(chunks):
            rows = range(row, row + len(tokens)) if i in full else [row + len(tokens) - 1] if last else []
            spans.append((len(picked), len(rows)))
            picked += rows
            row += len(tokens)
        return picked, spans

    def _chunk_outputs(self, chunks: Sequence[tuple[int, list[int], bool]], logits: torch.Tensor,
                       spans: list[tuple[int, int]], full: Collection[int] = (), hidden_from: int = 0
                       ) -> list[torch.Tensor | None]:
        """``prefill_chunks``' results from the chunks' logits [rows, vocab] (``spans`` index them, and
        ``model.last_hidden`` from row ``hidden_from``); attachments are told of each prompt completed."""
        out: list[torch.Tensor | None] = [None] * len(chunks)
        for i, (first, n) in enumerate(spans):
            if not n:
                continue
            out[i] = logits[first:first + n] if i in full else logits[first]
            if chunks[i][2]:
                for a in self.attached:
                    a.prefilled(chunks[i][0], self.runtime.model.last_hidden[hidden_from + first + n - 1])
        return out

    def fork(self, seq: int, children: Sequence[int]) -> None:
        """``seq``'s prompt KV is complete: each of ``children`` starts on it (n > 1 choices), its
        full pages shared and its partial last page copied (``PagedKVCache.fork``)."""
        for child in children:
            self.cache.fork(seq, child)

    def import_begin(self, seq: int, num_tokens: int) -> list[int]:
        """Allocate pages for the rest of a prompt of ``num_tokens`` tokens whose KV will arrive
        over the wire (after a reused prefix, if attached); returns the sequence's page ids."""
        have = self.cache.length(seq) if seq in self.cache.tables else 0
        self.cache.extend(seq, num_tokens - have)
        return self.cache.page_ids(seq)

    def import_chunk(self, pages: list[int], chunk: DecodedChunk) -> None:
        """Copy a verified chunk's bytes into the sequence's pages (no re-layout: same spec)."""
        n = chunk.k.shape[0]
        idx = torch.tensor(pages[chunk.first_page:chunk.first_page + n])
        k, v, ks, vs = self.cache.layer_tensors(chunk.layer)
        k.view(torch.uint8)[idx] = chunk.k.view(torch.uint8)
        v.view(torch.uint8)[idx] = chunk.v.view(torch.uint8)
        if ks is not None:
            ks[idx] = chunk.k_scale
            vs[idx] = chunk.v_scale

    def step(self, seqs: list[int], tokens: list[list[int]],
             chunks: Sequence[tuple[int, list[int], bool]] = ()) -> list[torch.Tensor]:
        """Feed ``tokens[i]`` to ``seqs[i]``; returns each one's logits [n_i, vocab].

        One token each is a plain decode step. With more (speculative verification) it is still
        one ``prepare`` and one forward: the paged cache (append-only pages) writes every new
        token, then attends each over the pages up to its own position in the same kernel call
        plain decoding makes, so its logits equal one-token-at-a-time decoding's. Call ``keep``
        afterwards to drop rejected tokens.

        ``chunks``: prompt chunks ``(seq, tokens, last)`` computed in the same forward, after the
        decode rows (only where ``rows_independent``: then every row gets the bits a step of its own
        kind gives it); their results, as ``prefill_chunks`` returns them, are in ``chunk_logits``."""
        t0 = time.perf_counter()
        counts = [len(ts) for ts in tokens]
        starts = [self.cache.length(s) if s in self.cache.tables else 0 for s in seqs]
        if chunks:
            if not self.rows_independent:
                raise ValueError("prompt chunks ride along a decode step only on row-independent kernels")
            sizes = [len(ch) for _, ch, _ in chunks]
            positions = self.cache.prepare([*seqs, *(seq for seq, _, _ in chunks)], [*counts, *sizes],
                                           prefill=[False] * len(seqs) + [True] * len(chunks))
            rows = sum(counts)
            picked, spans = self._chunk_rows(chunks, rows)
            logits = self.runtime.model(torch.tensor([t for ts in tokens for t in ts] + [t for _, ch, _ in chunks
                                                                                          for t in ch]),
                                        positions, self.cache,
                                        logits_rows=torch.tensor([*range(rows), *picked], dtype=torch.int64))
            took, plain = time.perf_counter() - t0, self.step_cost.step(len(seqs))
            if plain is not None and took > plain:  # the chunks' share: the time beyond such a decode step
                self.step_cost.add_prefill(sum(sizes), took - plain)
        else:
            positions = self.cache.prepare(seqs, counts)
            logits = self.runtime.model(torch.tensor([t for ts in tokens for t in ts]), positions,
                                        self.cache)  # [num_tokens, vocab]
            self.step_cost.add(len(seqs), sum(counts), time.perf_counter() - t0)
            rows = logits.shape[0]
        self._starts = {s: (start, n) for s, start, n in zip(seqs, starts, counts) if n > 1}
        for a in self.attached:
            a.stepped(seqs, self.runtime.model.last_hidden[:rows].split(counts))
        # the chunks' rows follow the decode rows'
        self.chunk_logits = self._chunk_outputs(chunks, logits[rows:], spans, hidden_from=rows) if chunks else []
        return list(logits[:rows].split(counts))

    def replay(self, items: Sequence[tuple[int, list[int], bool]]) -> None:
        """Feed again ``(seq, tokens, last)``, tokens a preempted sequence had decoded (at most
        MAX_PAGED_QUERIES each), after what its pages hold now: the decode kernel writes each
        token's K/V as one-token decoding did, bit for bit (each row attends over the pages up to
        itself). No logits but the last row's hidden state, which attachments get as at a prefill
        where ``last`` (the pending token follows)."""
        counts = [len(tokens) for _, tokens, _ in items]
        positions = self.cache.prepare([seq for seq, _, _ in items], counts)
        rows = [i for i, (_, _, last) in enumerate(items) if last]
        ends = torch.tensor(counts).cumsum(0) - 1
        self.runtime.model(torch.tensor([t for _, tokens, _ in items for t in tokens]), positions, self.cache,
                           logits_rows=ends[rows])
        for j, i in enumerate(rows):
            for a in self.attached:
                a.prefilled(items[i][0], self.runtime.model.last_hidden[j])

    def keep(self, seq: int, num_kept: int) -> None:
        """After a multi-token ``step``: keep the first ``num_kept`` of ``seq``'s tokens, roll the
        rest back: a truncate, exact with append-only pages (emptied pages return to the pool)."""
        if seq not in self._starts:
            return  # one token fed, or already freed: nothing to roll back
        start, n = self._starts.pop(seq)
        if not 1 <= num_kept <= n:
            raise ValueError(f"sequence {seq}: cannot keep {num_kept} of {n} tokens")
        if num_kept < n and seq in self.cache.tables:
            self.cache.truncate(seq, start + num_kept)

    # ---- lifecycle ----------------------------------------------------------------------------

    def warm_up(self) -> None:
        """A short prompt, decode and verify steps (and the attachments' own paths) through the
        real paths, then forget them (all but their timings)."""
        seq = -1
        self.cache.prepare([seq], [8])
        self.runtime.model(torch.zeros(8, dtype=torch.int64), torch.arange(8), self.cache)
        for _ in range(2):
            self.step([seq], [[0]])
        # 1..9 rows in turn, a few times: StepCost's first prices, so the first requests size their
        # n-gram proposals to this machine (real steps take over as they come)
        for _ in range(self.step_cost.min_steps):
            for rows in range(1, 10):
                self.step([seq], [[0] * rows])
                self.keep(seq, 1)
        for a in self.attached:
            a.warm_up(seq)
        self.free(seq)

    def free(self, seq: int) -> None:
        self._starts.pop(seq, None)
        self.cache.reset(seq)  # unknown ids are fine: a request may end before its pages existed
        for a in self.attached:
            a.free(seq)

    def stats(self) -> dict[str, int]:
        return {**self.cache.stats(), "cached_pages": len(self.prefix) if self.prefix is not None else 0}
