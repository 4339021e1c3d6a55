"""The paged KV cache: FP8 (or bf16) pages from a PagePool, read by paged attention.

Same calling pattern as ``DenseKVCache``: ``prepare(seq_ids, num_new)`` before each forward step,
then the model calls ``attend`` once per layer. Page tensors keep ``KVPageSpec``'s layout exactly,
per layer ``k: [num_pages, num_kv_heads, block_size, head_dim]`` and ``k_scale: [num_pages,
num_kv_heads]`` float32 (v alike), so the wire codec copies page bytes in and out unchanged.

Per sequence, a step's attention is one of:
  - fresh prompt (new tokens start at position 0): plain causal attention over this step's
    full-precision K/V (exactly what DenseKVCache computes); the K/V are also written to pages;
  - one-token decode: write, then ``paged_decode_attention`` over the pages, batched over all
    decode sequences of the step in one call;
  - several tokens after existing context (chunked scoring, e.g. bench/accuracy.py): write,
    dequantize that sequence's visible pages, masked sdpa (decode_svc verifies speculative
    tokens one round at a time through the decode kernel instead, see decode_svc/runner.py);
Rejected speculative tokens are dropped with ``truncate``; a kept page's scale may stay larger
than its remaining entries need (scales only grow), which costs a little precision, never
correctness.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvwire.config import KVDtype, ModelConfig
from kvwire.kv.dense import attention_mask, sdpa_gqa
from kvwire.kv.pool import RELEASED, BlockTables, OutOfPages, PagePool
from kvwire.kv.spec import KVPageSpec
from kernels import dispatch

TORCH_KV_DTYPES = {KVDtype.FP8_E4M3: torch.float8_e4m3fn, KVDtype.BF16: torch.bfloat16}


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, spec: KVPageSpec, num_pages: int,
                 device: str | torch.device = "cpu"):
        if (spec.num_layers, spec.num_kv_heads, spec.head_dim) != (
                cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            raise ValueError(f"KVPageSpec {spec.to_dict()} does not fit the model "
                             f"({cfg.num_layers} layers, {cfg.num_kv_heads} kv heads, head_dim {cfg.head_dim})")
        self.cfg, self.spec, self.device = cfg, spec, torch.device(device)
        shape = (cfg.num_layers, num_pages, cfg.num_kv_heads, spec.block_size, cfg.head_dim)
        # One allocation per kind; [layer] views are contiguous and already in wire layout.
        self.k = torch.zeros(shape, dtype=TORCH_KV_DTYPES[spec.dtype], device=self.device)
        self.v = torch.zeros_like(self.k)
        scale_shape = (cfg.num_layers, num_pages, cfg.num_kv_heads)
        self.k_scale = torch.zeros(scale_shape, device=self.device) if spec.has_scales else None
        self.v_scale = torch.zeros(scale_shape, device=self.device) if spec.has_scales else None
        windows = cfg.layer_windows or (None,)
        # Pages can go back only when no layer needs them: every layer must have a window.
        window = None if any(w is None for w in windows) else max(windows)
        self.pool = PagePool(num_pages)
        self.tables = BlockTables(self.pool, spec.block_size, window)
        self.sm_scale = cfg.head_dim ** -0.5
        self._step: list[tuple[int, int, int]] = []  # (seq_id, start, num_new)

    # ---- sequences and pages ------------------------------------------------------------------

    def add_sequence(self, seq_id: int) -> None:
        self.tables.add(seq_id)

    def free_sequence(self, seq_id: int) -> None:
        self.tables.free(seq_id)

    def reset(self, seq_id: int) -> None:
        """DenseKVCache-compatible: forget the sequence (its pages go back to the pool)."""
        if seq_id in self.tables:
            self.tables.free(seq_id)

    def truncate(self, seq_id: int, length: int) -> None:
        self.tables.truncate(seq_id, length)

    def length(self, seq_id: int) -> int:
        return self.tables.length(seq_id)

    def page_ids(self, seq_id: int) -> list[int]:
        """The sequence's block table: page id per block of block_size positions, RELEASED (-1)
        for pages given back behind the sliding window."""
        return list(self.tables.table(seq_id))

    def layer_tensors(self, layer: int):
        """(k, v, k_scale, v_scale) of one layer: pages [num_pages, Hkv, B, D], scales [num_pages,
        Hkv] float32 or None for bf16. Views into the cache: writes through them are seen."""
        ks = None if self.k_scale is None else self.k_scale[layer]
        vs = None if self.v_scale is None else self.v_scale[layer]
        return self.k[layer], self.v[layer], ks, vs

    def can_fit(self, num_tokens: int, seq_id: int | None = None) -> bool:
        need = (self.tables.pages_needed(seq_id, num_tokens) if seq_id is not None
                else self.spec.pages_for(num_tokens))
        return need <= self.pool.num_free

    def stats(self) -> dict[str, int]:
        return self.pool.stats()

    def extend(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow a sequence by ``num_tokens`` without computing anything (for K/V that arrives
        over the wire): returns the new pages, scales zeroed, for the caller to fill."""
        if seq_id not in self.tables:
            self.tables.add(seq_id)
        new = self.tables.append([(seq_id, num_tokens)])
        self._zero_scales(new)
        return new

    def _zero_scales(self, pages: list[int]) -> None:
        if pages and self.k_scale is not None:  # a fresh page's scale is 0: "holds nothing"
            idx = torch.tensor(pages, device=self.device)
            self.k_scale[:, idx] = 0.0
            self.v_scale[:, idx] = 0.0

    # ---- one forward step ---------------------------------------------------------------------

    def prepare(self, seq_ids: Sequence[int], num_new: Sequence[int]) -> torch.Tensor:
        """Declare the next step (``num_new[i]`` tokens for ``seq_ids[i]``, in that order) and
        allocate its pages; unknown ids are added. Returns positions, [sum(num_new)] int64.
        Raises OutOfPages, changing nothing, when the pages do not fit."""
        added = [s for s in dict.fromkeys(seq_ids) if s not in self.tables]
        for s in added:
            self.tables.add(s)
        for s in seq_ids:
            self.tables.release_outside_window(s)  # before allocating: they are reusable now
        starts = [self.tables.length(s) for s in seq_ids]
        try:
            self._zero_scales(self.tables.append(list(zip(seq_ids, num_new))))
        except OutOfPages:
            for s in added:
                self.tables.free(s)
            raise
        self._step = list(zip(seq_ids, starts, num_new))
        bs, slots, positions = self.spec.block_size, [], []
        for s, start, n in self._step:
            table = self.tables.table(s)
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
        self._slots = torch.tensor(slots, dtype=torch.int64, device=self.device)  # [num_tokens]
        decode = [i for i, (_, start, n) in enumerate(self._step) if n == 1 and start > 0]
        self._all_decode = bool(decode) and len(decode) == len(self._step)
        first_rows = [0]
        for _, _, n in self._step:
            first_rows.append(first_rows[-1] + n)
        self._decode_rows = torch.tensor([first_rows[i] for i in decode], dtype=torch.int64,
                                         device=self.device)  # [S] rows of q that decode
        if decode:
            tabs = [self.tables.table(self._step[i][0]) for i in decode]
            width = max(len(t) for t in tabs)
            self._block_tables = torch.tensor([t + [RELEASED] * (width - len(t)) for t in tabs],
                                              dtype=torch.int32, device=self.device)  # [S, max_blocks]
            self._ctx = torch.tensor([self._step[i][1] + 1 for i in decode], dtype=torch.int32,
                                     device=self.device)  # [S]
        return torch.tensor(positions, dtype=torch.int64, device=self.device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None) -> torch.Tensor:
        k_pages, v_pages, k_scale, v_scale = self.layer_tensors(layer)
        dispatch.write_kv(k_pages, v_pages, k_scale, v_scale, k, v, self._slots)
        if self._all_decode:  # the hot path: one batched call, no per-sequence Python
            return dispatch.paged_decode_attention(q, k_pages, v_pages, k_scale, v_scale,
                                                   self._block_tables, self._ctx, window, self.sm_scale)
        out, row = torch.empty_like(q), 0
        for seq_id, start, n in self._step:
            rows = slice(row, row + n)
            row += n
            if n == 0:
                continue
            if start == 0:  # fresh prompt: this step's K/V are the whole context
                pos = torch.arange(n, device=q.device)
                mask = None if window is None or n <= window else attention_mask(pos, pos, window)
                out[rows] = sdpa_gqa(q[rows], k[rows], v[rows], mask, causal=True)
            elif n > 1:
                out[rows] = self._attend_pages(layer, seq_id, q[rows], start, n, window)
        if self._decode_rows.numel():
            idx = self._decode_rows
            out[idx] = dispatch.paged_decode_attention(q[idx], k_pages, v_pages, k_scale, v_scale,
                                                       self._block_tables, self._ctx, window, self.sm_scale)
        return out

    def _attend_pages(self, layer: int, seq_id: int, q: torch.Tensor, start: int, n: int,
                      window: int | None) -> torch.Tensor:
        """Several new queries after existing context: dequantize the visible pages, mask, sdpa."""
        bs, end = self.spec.block_size, start + n
        first_block = 0 if window is None else max(0, start - window + 1) // bs
        ids = torch.tensor(self.tables.table(seq_id)[first_block:-(-end // bs)], device=self.device)
        k_pages, v_pages, k_scale, v_scale = self.layer_tensors(layer)
        lo = first_block * bs
        keys = dispatch.dequantize_pages(k_pages, k_scale, ids)  # [nb, Hkv, B, D]
        vals = dispatch.dequantize_pages(v_pages, v_scale, ids)
        _, hkv, _, d = keys.shape
        keys = keys.transpose(1, 2).reshape(-1, hkv, d)[:end - lo]  # [ctx, Hkv, D], positions lo..end-1
        vals = vals.transpose(1, 2).reshape(-1, hkv, d)[:end - lo]
        mask = attention_mask(torch.arange(start, end, device=q.device),
                              torch.arange(lo, end, device=q.device), window)
        return sdpa_gqa(q, keys.to(q.dtype), vals.to(q.dtype), mask)
