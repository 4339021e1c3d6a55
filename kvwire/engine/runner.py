"""ModelRunner: the tensor side of the engine (no asyncio, no gRPC).

Owns the paged KV cache and, for speculative decoding, a draft: a draft model with its own paged
cache, or a draft head (``kvwire.model.draft_head``) that reads the target's hidden states and
keeps no cache, only each sequence's latest feature.
A sequence's prompt KV gets into its pages one of two ways: computed here (``prefill``, the local
KV source) or imported page by page from the wire (``import_begin`` / ``import_chunk``, the remote
one); then sequences advance together: one ``step`` runs one batched forward for every decoding
sequence, one token each, or several for a speculative verification. Not thread-safe by design:
the engine makes every call from one thread, in submission order, so a sequence is never freed
under a step or an import.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvwire.engine.chunked import PrefixPrefill
from kvwire.engine.prefix_cache import PrefixCache, cache_salt
from kvwire.engine.speculative import draft_sample
from kvwire.engine.step_cost import StepCost
from kvwire.kv.wire import DecodedChunk
from kvwire.model.draft_head import DraftHead
from kvwire.model.fast_head import FastHead
from kvwire.runtime import Runtime
from kvwire.sampling_params import SamplingParams


class ModelRunner:
    def __init__(self, runtime: Runtime, num_pages: int, draft: Runtime | DraftHead | None = None,
                 draft_pages: int | None = None, prefix_caching: bool = False):
        self.runtime = runtime
        self.cache = runtime.new_cache(num_pages)
        # Not with a sliding window: pages behind it are given back, so a prefix is not kept whole.
        self.prefix = PrefixCache(self.cache.pool, runtime.spec.block_size, cache_salt(runtime.fingerprint, runtime.spec)) \
            if prefix_caching and self.cache.tables.window is None else None
        self.draft = draft
        self.head = draft if isinstance(draft, DraftHead) else None
        # The draft holds at most as many tokens per sequence as the target, so a pool as large as
        # the target's never runs out under the scheduler's reservations.
        self.draft_cache = draft.new_cache(draft_pages or num_pages) if isinstance(draft, Runtime) else None
        # Draft head: seq -> the target's final normed hidden state [hidden] at the position before
        # the pending token (what the head continues from), and the last step's rows per sequence.
        self.features: dict[int, torch.Tensor] = {}
        self._hidden: dict[int, torch.Tensor] = {}
        self._head_seconds: tuple[float, int] = (0.0, 0)  # running mean of one chained head call, calls
        # the head in C where the kernels read its layers (kvwire.model.fast_head): a greedy chain in
        # one call, a sampling chain one call per evaluation
        self.fast_head = FastHead.build(self.head) if self.head is not None else None
        # seq -> (its length before, tokens fed) in the last multi-token step: what ``keep`` rolls back
        self._starts: dict[int, tuple[int, int]] = {}
        self.step_cost = StepCost()  # what a verification row costs here, from ``step``'s timings

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
        """Compute a prompt's KV into new pages of ``seq`` (after a reused prefix, if attached);
        returns the last position's logits [vocab]. The same forward prefill_svc runs, so the
        pages hold the same bytes."""
        start = self.cache.length(seq) if seq in self.cache.tables else 0
        positions = self.cache.prepare([seq], [len(tokens) - start])
        kv = PrefixPrefill(self.cache, seq, start, len(tokens) - start) if start else self.cache
        logits = self.runtime.model(torch.tensor(tokens[start:]), positions, kv,
                                    logits_rows=torch.tensor([len(tokens) - start - 1]))
        self.remember_prefix(seq, tokens)
        if self.head is not None:
            self.features[seq] = self.runtime.model.last_hidden[0]
        return logits[0]

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

    def step(self, seqs: list[int], tokens: list[list[int]]) -> list[torch.Tensor]:
        """Feed ``tokens[i]`` to ``seqs[i]``; returns each one's logits [n_i, vocab].

        One token each is a plain decode step. With more (speculative verification) it is still
        one ``prepare`` and one forward: the paged cache (append-only pages) writes every new
        token, then attends each over the pages up to its own position in the same kernel call
        plain decoding makes, so its logits equal one-token-at-a-time decoding's. Call ``keep``
        afterwards to drop rejected tokens."""
        t0 = time.perf_counter()
        counts = [len(ts) for ts in tokens]
        starts = [self.cache.length(s) if s in self.cache.tables else 0 for s in seqs]
        positions = self.cache.prepare(seqs, counts)
        logits = self.runtime.model(torch.tensor([t for ts in tokens for t in ts]), positions,
                                    self.cache)  # [num_tokens, vocab]
        self.step_cost.add(len(seqs), sum(counts), time.perf_counter() - t0)
        self._starts = {s: (start, n) for s, start, n in zip(seqs, starts, counts) if n > 1}
        if self.head is not None:
            self._hidden = dict(zip(seqs, self.runtime.model.last_hidden.split(counts)))
        return list(logits.split(counts))

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

    # ---- draft model or head ------------------------------------------------------------------

    @property
    def draft_positions(self) -> int:
        """Tokens a sequence may hold for the draft to propose after it (a head has no limit)."""
        if self.head is not None:
            return 1 << 62
        return self.draft.model_config.max_position_embeddings if self.draft is not None else 0

    def can_propose(self, seq: int) -> bool:
        """A draft head needs the target's feature before the pending token: a sequence whose
        prompt KV came over the wire has none until its first decode step."""
        return self.head is None or seq in self.features

    def head_cost(self, batch: int) -> float | None:
        """What one draft-head proposal adds to a step of ``batch`` requests, in plain steps of a
        request (StepCost's unit: a plain step's time over ``batch``), as if its chained head call
        served that request alone; None until both were measured."""
        plain = self.step_cost.plain(batch)
        mean, n = self._head_seconds
        return mean / plain * batch if plain is not None and n >= self.step_cost.min_steps else None

    def advance(self, seq: int, row: int) -> None:
        """After ``step``: the pending token of ``seq`` was chosen from the logits of its fed token
        number ``row`` (0: plain step; the number of accepted proposals after a verification), so
        that row's hidden state is what a draft head continues from."""
        rows = self._hidden.get(seq)
        if rows is not None:
            self.features[seq] = rows[row]

    def propose(self, seqs: Sequence[int], contexts: Sequence[Sequence[int]], ks: Sequence[int],
                params: Sequence[SamplingParams], first_steps: Sequence[int]):
        """Draft ``ks[i]`` tokens after ``contexts[i]`` (prompt + generated, ending with the
        pending token) for each sequence, batched. The draft first catches up on the context it
        has not seen (the whole prompt the first time). Returns (tokens [k_i], q [k_i, vocab] or
        None when greedy, confidence) per sequence: the confidence is a draft head's probability
        of each proposal (``_propose_head``), None for a draft model."""
        if self.head is not None:
            return self._propose_head(seqs, contexts, ks, params, first_steps)
        dc, model = self.draft_cache, self.draft.model
        feeds = [list(ctx[dc.length(s) if s in dc.tables else 0:]) for s, ctx in zip(seqs, contexts)]
        ends = torch.tensor([len(f) for f in feeds]).cumsum(0) - 1
        positions = dc.prepare(seqs, [len(f) for f in feeds])
        logits = model(torch.tensor([t for f in feeds for t in f]), positions, dc, logits_rows=ends)  # [S, vocab]
        props: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        while True:
            for i, row in zip(active, logits):
                tok, q = draft_sample(row, params[i], first_steps[i] + len(props[i]))
                props[i].append(tok)
                if q is not None:
                    qs[i].append(q)
            active = [i for i in active if len(props[i]) < ks[i]]
            if not active:
                break
            positions = dc.prepare([seqs[i] for i in active], [1] * len(active))
            logits = model(torch.tensor([props[i][-1] for i in active]), positions, dc)
        return [(p, torch.stack(q) if q else None, None) for p, q in zip(props, qs)]

    def _propose_head(self, seqs, contexts, ks, params, first_steps, stop_below: float = 0.25):
        """``propose`` with the draft head: chained from each sequence's feature and pending token,
        batched over the sequences still drafting. A sequence stops drafting once the product of
        its proposals' confidences (the head's probability of its top token) is below ``stop_below``:
        the next one would be accepted too rarely to be worth its row. All greedy: the whole chain in
        one C call (``FastHead``); else each proposal is drawn here, over the head's vocabulary."""
        feats = torch.stack([self.features[s] for s in seqs])  # [S, hidden]
        if self.fast_head is not None and all(p.greedy for p in params):
            t0 = time.perf_counter()
            props, confs, calls = self.fast_head(feats, [ctx[-1] for ctx in contexts], list(ks), stop_below)
            if calls:
                self._time_head((time.perf_counter() - t0) / calls)
            return [(p, None, c) for p, c in zip(props, confs)]
        toks = torch.tensor([ctx[-1] for ctx in contexts])  # [S]
        props: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        confs: list[list[float]] = [[] for _ in seqs]
        reach = [1.0] * len(seqs)
        active = list(range(len(seqs)))
        head = self.head if self.fast_head is None else self.fast_head.forward
        while active:
            t0 = time.perf_counter()
            feats, small = head(feats, toks)  # [A, hidden], [A, head_vocab]
            self._time_head(time.perf_counter() - t0)
            top, arg = torch.softmax(small, dim=-1).max(-1)
            best = self.head.head_vocab[arg].tolist()  # greedy proposals: no full-vocab row
            for j, i in enumerate(active):
                confs[i].append(float(top[j]))
                reach[i] *= confs[i][-1]
                if params[i].greedy:
                    props[i].append(best[j])
                    continue
                tok, q = draft_sample(small[j], params[i], first_steps[i] + len(props[i]),  # over its vocabulary
                                      self.head.head_vocab, self.head.cfg.vocab_size)
                props[i].append(tok)
                qs[i].append(q)
            more = [j for j, i in enumerate(active) if len(props[i]) < ks[i] and reach[i] >= stop_below]
            active = [active[j] for j in more]
            feats, toks = feats[more], torch.tensor([props[i][-1] for i in active], dtype=torch.int64)
        return [(p, torch.stack(q) if q else None, c) for p, q, c in zip(props, qs, confs)]

    def _time_head(self, seconds: float) -> None:
        """One chained head call took ``seconds``: into the running mean ``head_cost`` reads."""
        mean, n = self._head_seconds
        n += 1
        self._head_seconds = (mean + max(self.step_cost.weight, 1.0 / n) * (seconds - mean), n)

    def draft_truncate(self, seq: int, length: int) -> None:
        """Keep at most ``length`` tokens of the draft's KV for ``seq`` (rejected proposals go)."""
        if self.draft_cache is not None and seq in self.draft_cache.tables:
            self.draft_cache.truncate(seq, min(length, self.draft_cache.length(seq)))

    # ---- lifecycle ----------------------------------------------------------------------------

    def warm_up(self) -> None:
        """A short prompt, decode and verify steps (and draft proposals) through the real paths,
        then forget them (all but their timings)."""
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
        if self.draft is not None:
            self.advance(seq, 0)
            for _ in range(self.step_cost.min_steps if self.head is not None else 1):  # the head's price too
                self.propose([seq], [[0] * 12], [3], [SamplingParams()], [0])
        self.free(seq)

    def free(self, seq: int) -> None:
        self._starts.pop(seq, None)
        self.features.pop(seq, None)
        self._hidden.pop(seq, None)
        self.cache.reset(seq)  # unknown ids are fine: a request may end before its pages existed
        if self.draft_cache is not None:
            self.draft_cache.reset(seq)

    def stats(self) -> dict[str, int]:
        return {**self.cache.stats(), "cached_pages": len(self.prefix) if self.prefix is not None else 0}
