"""Prefill after a reused prefix: the new tokens attend over the cached pages plus themselves.

A stand-in for the paged cache during the forward of a prompt's uncached part (the pages of the
prefix are already in place, see kvwire/engine/prefix_cache.py). Per layer: write the new K/V to
their pages, dequantize the prefix's pages once, and run causal sdpa of the new queries over
[prefix from pages] + [new K/V at full precision]: the new tokens see each other exactly as in a
fresh prompt's forward, and the prefix as decoding reads it. Cost: one dequantization of the
prefix per layer, whatever the number of new tokens.
"""
from __future__ import annotations

import torch

from kvwire.kv.dense import attention_mask, sdpa_gqa
from kvwire_kernels import dispatch


class PrefixPrefill:
    def __init__(self, cache, seq: int, start: int, num_new: int):
        """Call after ``cache.prepare([seq], [num_new])`` (which allocated the new pages)."""
        bs, dev = cache.spec.block_size, cache.device
        table = cache.page_ids(seq)
        self.cache, self.start = cache, start
        self.prefix_pages = torch.tensor(table[:start // bs], dtype=torch.int64, device=dev)  # full pages
        pos = range(start, start + num_new)
        self.slots = torch.tensor([table[p // bs] * bs + p % bs for p in pos], dtype=torch.int64, device=dev)
        self.q_pos = torch.arange(start, start + num_new, device=dev)
        self.k_pos = torch.arange(0, start + num_new, device=dev)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None) -> torch.Tensor:
        k_pages, v_pages, k_scale, v_scale = self.cache.layer_tensors(layer)
        dispatch.write_kv(k_pages, v_pages, k_scale, v_scale, k, v, self.slots)
        _, hkv, d = k.shape  # [num_new, num_kv_heads, head_dim]
        keys = dispatch.dequantize_pages(k_pages, k_scale, self.prefix_pages)  # [nb, Hkv, B, D]
        vals = dispatch.dequantize_pages(v_pages, v_scale, self.prefix_pages)
        keys = torch.cat([keys.transpose(1, 2).reshape(-1, hkv, d).to(q.dtype), k])  # [start + n, Hkv, D]
        vals = torch.cat([vals.transpose(1, 2).reshape(-1, hkv, d).to(q.dtype), v])
        return sdpa_gqa(q, keys, vals, attention_mask(self.q_pos, self.k_pos, window))
