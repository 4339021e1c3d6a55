"""Decode runner: the tensor side of decode_svc (no asyncio, no gRPC).

Owns the paged KV cache (and, for speculative decoding, a draft model with its own paged cache).
Sequences arrive with their prompt KV imported page by page from the wire (``import_begin`` /
``import_chunk``), then advance together: one ``step`` runs one batched forward for every decoding
sequence, one token each, or several for a speculative verification. Not thread-safe by design:
the engine makes every call from one worker thread, in submission order, so a sequence is never
freed under a step or an import.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvwire.kv.pool import RELEASED
from kvwire.kv.wire import DecodedChunk
from kvwire.runtime import Engine
from kvwire.sampling import SamplingParams
from decode_svc.speculative import draft_sample
from kernels import dispatch


class DecodeRunner:
    def __init__(self, engine: Engine, num_pages: int, draft: Engine | None = None,
                 draft_pages: int | None = None):
        self.engine = engine
        self.cache = engine.new_cache(num_pages)
        self.draft = draft
        # The draft holds at most as many tokens per sequence as the target, so a pool as large as
        # the target's never runs out under the scheduler's reservations.
        self.draft_cache = draft.new_cache(draft_pages or num_pages) if draft is not None else None
        self._verify: _ExactMultiTokenStep | None = None

    def import_begin(self, seq: int, num_tokens: int) -> list[int]:
        """Allocate pages for a prompt whose KV will arrive over the wire; returns its page ids."""
        self.cache.extend(seq, num_tokens)
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

        One token each is a plain decode step. With more (speculative verification), every token
        sees exactly the KV state a one-token-at-a-time decode would have given it, so its logits
        equal plain decoding's bit for bit; call ``keep`` afterwards to drop rejected tokens."""
        counts = [len(ts) for ts in tokens]
        flat = torch.tensor([t for ts in tokens for t in ts])
        self._verify = None
        if all(n == 1 for n in counts):
            positions = self.cache.prepare(seqs, counts)
            logits = self.engine.model(flat, positions, self.cache)  # [num_tokens, vocab]
        else:
            starts = [self.cache.length(s) if s in self.cache.tables else 0 for s in seqs]
            positions = self.cache.prepare(seqs, counts)
            self._verify = _ExactMultiTokenStep(self.cache, seqs, starts, counts)
            logits = self.engine.model(flat, positions, self._verify)
        return list(logits.split(counts))

    def keep(self, seq: int, num_kept: int) -> None:
        """After a multi-token ``step``: keep the first ``num_kept`` of ``seq``'s tokens, roll the
        rest back (pages left empty return to the pool)."""
        if self._verify is not None:
            self._verify.keep(seq, num_kept)

    # ---- draft model --------------------------------------------------------------------------

    def propose(self, seqs: Sequence[int], contexts: Sequence[Sequence[int]], ks: Sequence[int],
                params: Sequence[SamplingParams], first_steps: Sequence[int]):
        """Draft ``ks[i]`` tokens after ``contexts[i]`` (prompt + generated, ending with the
        pending token) for each sequence, batched. The draft first catches up on the context it
        has not seen (the whole prompt the first time). Returns (tokens [k_i], q [k_i, vocab] or
        None when greedy) per sequence."""
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
        return [(p, torch.stack(q) if q else None) for p, q in zip(props, qs)]

    def draft_truncate(self, seq: int, length: int) -> None:
        """Keep at most ``length`` tokens of the draft's KV for ``seq`` (rejected proposals go)."""
        if self.draft_cache is not None and seq in self.draft_cache.tables:
            self.draft_cache.truncate(seq, min(length, self.draft_cache.length(seq)))

    # ---- lifecycle ----------------------------------------------------------------------------

    def warm_up(self) -> None:
        """A short prompt, decode and verify steps (and draft proposals) through the real paths,
        then forget them."""
        seq = -1
        self.cache.prepare([seq], [8])
        self.engine.model(torch.zeros(8, dtype=torch.int64), torch.arange(8), self.cache)
        for _ in range(2):
            self.step([seq], [[0]])
        self.step([seq], [[0, 1, 2]])
        self.keep(seq, 1)
        if self.draft is not None:
            self.propose([seq], [[0] * 12], [3], [SamplingParams()], [0])
        self.free(seq)

    def truncate(self, seq: int, length: int) -> None:
        self.cache.truncate(seq, length)

    def free(self, seq: int) -> None:
        self.cache.reset(seq)  # unknown ids are fine: a request may end before its pages existed
        if self.draft_cache is not None:
            self.draft_cache.reset(seq)

    def stats(self) -> dict[str, int]:
        return self.cache.stats()


class _ExactMultiTokenStep:
    """A stand-in for the paged cache during a step where sequences take several tokens.

    Why: the cache's own multi-token path writes all new K/V first and attends with sdpa, so a
    query sees K/V quantized with page scales that later tokens of the step may have grown, and
    sums in another order than the one-token decode kernel: logits then differ from plain decoding
    in the last bits, enough to flip a near-tie argmax. Here the step runs in rounds: round r
    writes every sequence's r-th new token and attends with the same ``paged_decode_attention``
    call plain decoding makes, so each query sees exactly the state plain decoding gives it. The
    matmuls still run once over all tokens of the step, which is where batching pays.

    Rollback: writes after round r may grow the scale of the page holding round r's token and
    requantize it. So after each round the page just written is copied (fp8 only, and only if a
    later round writes into it); ``keep`` puts that copy back before truncating.
    """

    def __init__(self, cache, seqs: list[int], starts: list[int], counts: list[int]):
        self.cache, self.seqs = cache, seqs
        self.starts = dict(zip(seqs, starts))
        self.counts = dict(zip(seqs, counts))
        bs, dev = cache.spec.block_size, cache.device
        offsets = [0]
        for n in counts:
            offsets.append(offsets[-1] + n)
        tables = {s: cache.page_ids(s) for s in seqs}
        self.rounds = []  # per round: rows, slots, block tables, context lengths, checkpoint pages
        for r in range(max(counts)):
            members = [i for i, n in enumerate(counts) if n > r]
            pos = [starts[i] + r for i in members]
            tabs = [tables[seqs[i]] for i in members]
            width = max(len(t) for t in tabs)
            ckpt = [(seqs[i], t[p // bs]) for i, p, t in zip(members, pos, tabs)
                    if r < counts[i] - 1 and (p + 1) % bs]  # a later round writes into this page
            self.rounds.append(dict(
                rows=torch.tensor([offsets[i] + r for i in members], device=dev),
                slots=torch.tensor([t[p // bs] * bs + p % bs for p, t in zip(pos, tabs)], device=dev),
                tables=torch.tensor([t + [RELEASED] * (width - len(t)) for t in tabs], dtype=torch.int32,
                                    device=dev),  # [S_r, max_blocks]
                ctx=torch.tensor([p + 1 for p in pos], dtype=torch.int32, device=dev),  # [S_r]
                ckpt_seqs={s: j for j, (s, _) in enumerate(ckpt)},
                ckpt_pages=torch.tensor([pg for _, pg in ckpt], dtype=torch.int64, device=dev)))
        self.saved: dict[tuple[int, int], tuple] = {}  # (layer, round) -> copies of checkpoint pages
        # bf16 pages have no scales, so a later write never changes an earlier entry: every round's
        # query can attend over the final state at once, as one "virtual sequence" per (seq, round).
        self.all_rows = torch.cat([rd["rows"] for rd in self.rounds])
        width = max(rd["tables"].shape[1] for rd in self.rounds)
        self.all_tables = torch.cat([torch.nn.functional.pad(rd["tables"], (0, width - rd["tables"].shape[1]),
                                                             value=RELEASED) for rd in self.rounds])
        self.all_ctx = torch.cat([rd["ctx"] for rd in self.rounds])
        self.all_slots = torch.cat([rd["slots"] for rd in self.rounds])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None) -> torch.Tensor:
        k_pages, v_pages, k_scale, v_scale = self.cache.layer_tensors(layer)
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
        if k_scale is None:
            rows = self.all_rows
            dispatch.write_kv(k_pages, v_pages, k_scale, v_scale, k[rows], v[rows], self.all_slots)
            out[rows] = dispatch.paged_decode_attention(q[rows], k_pages, v_pages, k_scale, v_scale, self.all_tables,
                                                        self.all_ctx, window, self.cache.sm_scale)
            return out
        for r, rd in enumerate(self.rounds):
            rows = rd["rows"]
            dispatch.write_kv(k_pages, v_pages, k_scale, v_scale, k[rows], v[rows], rd["slots"])
            out[rows] = dispatch.paged_decode_attention(q[rows], k_pages, v_pages, k_scale, v_scale, rd["tables"],
                                                        rd["ctx"], window, self.cache.sm_scale)
            if k_scale is not None and rd["ckpt_pages"].numel():
                idx = rd["ckpt_pages"]
                self.saved[layer, r] = (k_pages[idx], v_pages[idx], k_scale[idx], v_scale[idx])  # copies
        return out

    def keep(self, seq: int, num_kept: int) -> None:
        start, n = self.starts[seq], self.counts[seq]
        if not 1 <= num_kept <= n:
            raise ValueError(f"sequence {seq}: cannot keep {num_kept} of {n} tokens")
        if num_kept == n:
            return
        r = num_kept - 1
        j = self.rounds[r]["ckpt_seqs"].get(seq)
        if j is not None and (0, r) in self.saved:  # bf16 pages keep no copies: nothing requantizes
            page = int(self.rounds[r]["ckpt_pages"][j])
            for layer in range(self.cache.cfg.num_layers):
                k_pages, v_pages, k_scale, v_scale = self.cache.layer_tensors(layer)
                k_saved, v_saved, ks_saved, vs_saved = self.saved[layer, r]
                k_pages.view(torch.uint8)[page] = k_saved[j].view(torch.uint8)  # no fp8 index_put on CPU
                v_pages.view(torch.uint8)[page] = v_saved[j].view(torch.uint8)
                k_scale[page] = ks_saved[j]
                v_scale[page] = vs_saved[j]
        self.cache.truncate(seq, start + num_kept)
