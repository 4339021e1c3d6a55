"""The paged KV cache: FP8 (or bf16) pages from a PagePool in ``KVPageSpec``'s layout (copied to the wire as is).

Called as ``DenseKVCache`` (``prepare`` per step, ``attend`` per layer). Pages are append-only, and a
step's K/V are written to them before anything attends, so per sequence a step is: a fresh prompt
(causal attention over its full-precision K/V); up to ``MAX_PAGED_QUERIES`` tokens after context
(each attends over the pages up to its own position, so verifying k + 1 tokens gives plain
decoding's logits and rejection is ``truncate``); or more, or any prompt chunk (``prepare(...,
prefill=...)``): the context's pages dequantized once and the new tokens' own full-precision K/V,
causal attention (the CPU flash kernel or masked sdpa) -- a prompt computed in chunks sees its
earlier chunks as decoding will, and itself as an unchunked prompt does. A sequence may have several
chunks in one step: each starts where the one before ends and reads it from the pages, as in a step
of its own. Truncated slots and new pages are zeroed, so a page's bytes depend on its sequence's
tokens alone (reproducible wire checksums).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvwire.config import KVDtype, ModelConfig
from kvwire.kv.dense import attention_mask, sdpa_gqa
from kvwire.kv.pool import RELEASED, BlockTables, OutOfPages, PagePool
from kvwire.kv.spec import FORMAT_VERSION, KVPageSpec
from kvwire.kv.tuned import MAX_PAGED_QUERIES, PREFILL_KERNEL_MAX_KEYS_D128
from kvwire_kernels import cpu as cpu_kernels
from kvwire_kernels import dispatch
from kvwire_kernels.reference import SCALE_DTYPE

TORCH_KV_DTYPES = {KVDtype.FP8_E4M3: torch.float8_e4m3fn, KVDtype.BF16: torch.bfloat16}


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, spec: KVPageSpec, num_pages: int,
                 device: str | torch.device = "cpu"):
        if (spec.num_layers, spec.num_kv_heads, spec.head_dim) != (
                cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            raise ValueError(f"KVPageSpec {spec.to_dict()} does not fit the model "
                             f"({cfg.num_layers} layers, {cfg.num_kv_heads} kv heads, head_dim {cfg.head_dim})")
        if not spec.supported:
            raise ValueError(f"KV page format {spec.to_dict()} is not supported by this build "
                             f"(it holds format {FORMAT_VERSION} pages only)")
        self.cfg, self.spec, self.device = cfg, spec, torch.device(device)
        shape = (cfg.num_layers, num_pages, cfg.num_kv_heads, spec.block_size, cfg.head_dim)
        # One allocation per kind; [layer] views are contiguous and already in wire layout.
        self.k = torch.zeros(shape, dtype=TORCH_KV_DTYPES[spec.dtype], device=self.device)
        self.v = torch.zeros_like(self.k)
        scale_shape = (cfg.num_layers, num_pages, cfg.num_kv_heads, spec.block_size)
        self.k_scale = self.v_scale = None
        if spec.has_scales:
            self.k_scale = torch.zeros(scale_shape, dtype=SCALE_DTYPE, device=self.device)
            self.v_scale = torch.zeros_like(self.k_scale)
        windows = cfg.layer_windows or (None,)
        # Pages can go back only when no layer needs them: every layer must have a window.
        window = None if any(w is None for w in windows) else max(windows)
        self.pool = PagePool(num_pages)
        self.tables = BlockTables(self.pool, spec.block_size, window)
        self.sm_scale = cfg.head_dim ** -0.5
        self._step: list[tuple[int, int, int]] = []  # (seq_id, start, num_new)
        self._chunk: list[bool] = []  # per entry of _step: a prompt chunk
        self._prefill = False  # any entry is

    # ---- sequences and pages ------------------------------------------------------------------

    def free_sequence(self, seq_id: int) -> None:
        self.tables.free(seq_id)

    def reset(self, seq_id: int) -> None:
        """DenseKVCache-compatible: forget the sequence (its pages go back to the pool)."""
        if seq_id in self.tables:
            self.tables.free(seq_id)

    def fork(self, src: int, dst: int) -> None:
        """``dst`` starts as a copy of ``src``: the full pages shared, the partial last page copied
        (values and scales, every layer: the same bytes), so each appends its own tokens."""
        cow = self.tables.fork(src, dst)
        if cow is not None:
            old, new = cow
            for t in self._tensors():
                t[:, new] = t[:, old]

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep the first ``length`` tokens (rejected speculative tokens go). Exact: nothing kept
        changes, and the dropped slots of the last kept page are zeroed, so the cache holds the
        bytes it would hold had the dropped tokens never been written."""
        self.tables.truncate(seq_id, length)  # validates first
        offset = length % self.spec.block_size
        if offset:
            page = self.tables.table(seq_id)[length // self.spec.block_size]
            for t in self._tensors():
                t[:, page, :, offset:] = 0

    def length(self, seq_id: int) -> int:
        return self.tables.length(seq_id)

    def page_ids(self, seq_id: int) -> list[int]:
        """The sequence's block table: page id per block of block_size positions, RELEASED (-1)
        for pages given back behind the sliding window."""
        return list(self.tables.table(seq_id))

    def layer_tensors(self, layer: int):
        """(k, v, k_scale, v_scale) of one layer: pages [num_pages, Hkv, B, D], scales [num_pages,
        Hkv, B] bfloat16 or None for bf16 pages. Views into the cache: writes through them are seen."""
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
        over the wire): returns the new pages, zeroed, for the caller to fill."""
        if seq_id not in self.tables:
            self.tables.add(seq_id)
        new = self.tables.append([(seq_id, num_tokens)])
        self._zero_pages(new)
        return new

    def _tensors(self) -> list[torch.Tensor]:
        """Every page tensor as raw integers, slot dim 3: values [L, num_pages, Hkv, B, bytes],
        scales (fp8) [L, num_pages, Hkv, B] int16 (bf16 bits)."""
        ts = [self.k.view(torch.uint8), self.v.view(torch.uint8)]
        if self.k_scale is not None:
            ts += [self.k_scale.view(torch.int16), self.v_scale.view(torch.int16)]
        return ts

    def _zero_pages(self, pages: list[int]) -> None:
        """A fresh page holds zeros, whatever its previous owner wrote (no leak into the wire)."""
        if pages:
            idx = torch.tensor(pages, device=self.device)
            for t in self._tensors():
                t.index_fill_(1, idx, 0)

    # ---- one forward step ---------------------------------------------------------------------

    def prepare(self, seq_ids: Sequence[int], num_new: Sequence[int], prefill: bool | Sequence[bool] = False
                ) -> torch.Tensor:
        """Declare the next step (``num_new[i]`` tokens for ``seq_ids[i]``, in that order) and
        allocate its pages; unknown ids are added. ``prefill`` (all entries, or per entry): the tokens
        are prompt chunks (never kernel rows over the pages, whatever their number); a mixed step
        puts its decode entries first. Returns positions, [sum(num_new)] int64.
        Raises OutOfPages, changing nothing, when the pages do not fit."""
        chunk = [prefill] * len(seq_ids) if isinstance(prefill, bool) else list(prefill)
        added = [s for s in dict.fromkeys(seq_ids) if s not in self.tables]
        for s in added:
            self.tables.add(s)
        for s in seq_ids:
            self.tables.release_outside_window(s)  # before allocating: they are reusable now
        # A sequence may appear more than once (consecutive prompt chunks in one step): each entry
        # starts where the one before it ends, and the table grows once by their sum.
        totals = {s: 0 for s in seq_ids}
        starts = []
        for s, n in zip(seq_ids, num_new):
            starts.append(self.tables.length(s) + totals[s])
            totals[s] += n
        try:
            self._zero_pages(self.tables.append(list(totals.items())))
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
        # Rows of q that attend over pages: every new token of a sequence that has context,
        # each as its own kernel row (its sequence's block table, context up to itself).
        rows, tabs, ctx, row = [], [], [], 0
        for (s, start, n), is_chunk in zip(self._step, chunk):
            if start > 0 and n <= MAX_PAGED_QUERIES and not is_chunk:
                table = self.tables.table(s)
                rows.extend(range(row, row + n))
                tabs.extend([table] * n)
                ctx.extend(range(start + 1, start + n + 1))
            row += n
        self._all_paged = bool(rows) and len(rows) == row
        self._chunk = chunk
        self._prefill = any(chunk)
        self._paged_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)  # [R]
        if rows:
            width = max(len(t) for t in tabs)
            self._block_tables = torch.tensor([t + [RELEASED] * (width - len(t)) for t in tabs],
                                              dtype=torch.int32, device=self.device)  # [R, max_blocks]
            self._ctx = torch.tensor(ctx, dtype=torch.int32, device=self.device)  # [R]
        return torch.tensor(positions, dtype=torch.int64, device=self.device)

    def paged_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For a fused decode step (``kvwire.model.fast_decode``): when every token of the prepared
        step comes after context already in the pages (decode, verification), its slots [num_tokens]
        int64, block tables [num_tokens, max_blocks] int32 and context lengths [num_tokens] int32 (row
        i's query sits at ctx[i] - 1); else None."""
        if not self._all_paged or self.device.type != "cpu":
            return None
        return self._slots, self._block_tables, self._ctx

    def prefill_segments(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None] | None:
        """For a fused prefill step (``kvwire.model.fast_decode``): when the prepared step is prompt chunks
        (``prepare(prefill=...)``) on CPU, maybe after decode rows, its slots [num_tokens] int64, segments
        [S, 3] int64 (first row, rows, start position: one per chunk with tokens), their block tables
        [S, max_blocks] int32, and the decode rows' (block tables [R, max_blocks] int32, context lengths
        [R] int32) when there are some (rows 0..R-1, as ``paged_step`` gives them), else None. Each row
        attends as ``attend`` computes it. None when another kind of row is in the step."""
        if not self._prefill or self.device.type != "cpu":
            return None
        segments, tabs, row = [], [], 0
        for (s, start, n), is_chunk in zip(self._step, self._chunk):
            if n and is_chunk:
                segments.append([row, n, start])
                tabs.append(self.tables.table(s))
            row += n
        paged = self._paged_rows.numel()
        if not segments or sum(n for _, n, _ in segments) + paged != row or \
                (paged and self._paged_rows[-1].item() != paged - 1):  # decode rows first, then chunks: nothing else
            return None
        width = max(len(t) for t in tabs)
        tables = torch.tensor([t + [RELEASED] * (width - len(t)) for t in tabs], dtype=torch.int32)
        decode = (self._block_tables, self._ctx) if paged else None
        return self._slots, torch.tensor(segments, dtype=torch.int64), tables, decode

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None) -> torch.Tensor:
        k_pages, v_pages, k_scale, v_scale = self.layer_tensors(layer)
        dispatch.write_kv(k_pages, v_pages, k_scale, v_scale, k, v, self._slots)
        if self._all_paged:  # the hot path (decode, verification): one batched call
            return dispatch.paged_decode_attention(q, k_pages, v_pages, k_scale, v_scale,
                                                   self._block_tables, self._ctx, window, self.sm_scale)
        out, row = torch.empty_like(q), 0
        for (seq_id, start, n), is_chunk in zip(self._step, self._chunk):
            rows = slice(row, row + n)
            row += n
            if n == 0:
                continue
            if start == 0:  # fresh prompt: this step's K/V are the whole context
                out[rows] = self._causal(q[rows], k[rows], v[rows], 0, 0, window)
            elif n > MAX_PAGED_QUERIES or is_chunk:
                out[rows] = self._attend_pages(layer, seq_id, q[rows], k[rows], v[rows], start, window)
        if self._paged_rows.numel():
            idx = self._paged_rows
            out[idx] = dispatch.paged_decode_attention(q[idx], k_pages, v_pages, k_scale, v_scale,
                                                       self._block_tables, self._ctx, window, self.sm_scale)
        return out

    def _attend_pages(self, layer: int, seq_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      start: int, window: int | None) -> torch.Tensor:
        """New queries after ``start`` tokens of context: the visible context pages dequantized once,
        then the new tokens' own K/V at full precision; masked sdpa. q: [n, H, D]; k, v: [n, Hkv, D]."""
        bs, n = self.spec.block_size, q.shape[0]
        first_block = 0 if window is None else max(0, start - window + 1) // bs
        ids = torch.tensor(self.tables.table(seq_id)[first_block:-(-start // bs)], dtype=torch.int64,
                           device=self.device)
        k_pages, v_pages, k_scale, v_scale = self.layer_tensors(layer)
        lo = first_block * bs
        _, hkv, d = k.shape
        keys = dispatch.dequantize_pages(k_pages, k_scale, ids)  # [nb, Hkv, B, D]
        vals = dispatch.dequantize_pages(v_pages, v_scale, ids)
        keys = keys.transpose(1, 2).reshape(-1, hkv, d)[:start - lo].to(q.dtype)  # [start - lo, Hkv, D]
        vals = vals.transpose(1, 2).reshape(-1, hkv, d)[:start - lo].to(q.dtype)
        return self._causal(q, torch.cat([keys, k]), torch.cat([vals, v]), start, lo, window)

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos0: int, k_pos0: int,
                window: int | None) -> torch.Tensor:
        """q [n, H, D] at positions q_pos0.., over k, v [m, Hkv, D] at k_pos0.. that end with q's own:
        the CPU flash kernel for fp32 on CPU (about 2x torch's at 512 tokens; at head_dim 128 torch
        catches up from 1,024 keys: docs/decisions/061-prefill-attention.md), else sdpa with the
        causal (and window) mask."""
        n, m, d = q.shape[0], k.shape[0], q.shape[2]
        if (q.device.type == "cpu" and q.dtype == torch.float32 and cpu_kernels.available()
                and cpu_kernels.supports_prefill_attention(q.shape[1], k.shape[1], d)
                and (d <= 64 or m <= PREFILL_KERNEL_MAX_KEYS_D128)):
            return cpu_kernels.prefill_attention(q, k, v, q_pos0, k_pos0, window, self.sm_scale)
        if q_pos0 == k_pos0 and (window is None or n <= window):
            return sdpa_gqa(q, k, v, None, causal=True)
        mask = attention_mask(torch.arange(q_pos0, q_pos0 + n, device=q.device),
                              torch.arange(k_pos0, k_pos0 + m, device=q.device), window)
        return sdpa_gqa(q, k, v, mask)
