"""Exact multi-token steps over the paged cache, for speculative verification.

A step where sequences take several tokens must give each token the logits one-token-at-a-time
decoding would: greedy speculative output is then token for token the plain output.
"""
from __future__ import annotations

import torch

from kvwire.kv.pool import RELEASED
from kernels import dispatch


class ExactMultiTokenStep:
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
