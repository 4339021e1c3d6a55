"""A contiguous (unpaged) KV cache: the reference the paged FP8 cache is measured against.

Holds ``num_slots`` sequences of up to ``max_len`` tokens each, in full precision. Before each
forward step the caller says which slots take how many new tokens (``prepare``); the model then
calls ``attend`` once per layer.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvwire.config import ModelConfig


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean [num_q, num_k]: True where a query at q_pos may see a key at k_pos."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    return allowed


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
             causal: bool = False) -> torch.Tensor:
    """q: [n, H, D]; k, v: [m, Hkv, D] -> [n, H, D] (grouped-query attention).

    The inputs go in 4-D ([1, heads, tokens, head_dim]): on CPU, 3-D inputs with enable_gqa take the
    unfused math path, not the flash kernel (see docs/decisions/042-bf16-linear-and-loading.md)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],  # [1, heads, tokens, head_dim]
        attn_mask=mask, is_causal=causal and mask is None, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


class DenseKVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (cfg.num_layers, num_slots, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.lengths = [0] * num_slots
        self._step: list[tuple[int, int, int]] = []  # (slot, start, num_new) for this step

    def prepare(self, slots: Sequence[int], num_new: Sequence[int]) -> torch.Tensor:
        """Declare the next step: ``num_new[i]`` tokens for ``slots[i]``, in that order.

        Returns their positions, [sum(num_new)] int64.
        """
        self._step, positions = [], []
        for slot, n in zip(slots, num_new):
            start = self.lengths[slot]
            if start + n > self.max_len:
                raise ValueError(f"slot {slot}: {start + n} tokens exceed the cache's {self.max_len}")
            self._step.append((slot, start, n))
            self.lengths[slot] = start + n
            positions.append(torch.arange(start, start + n))
        return torch.cat(positions)

    def truncate(self, slot: int, length: int) -> None:
        """Forget everything past ``length`` tokens (rejected speculative tokens)."""
        self.lengths[slot] = min(self.lengths[slot], length)

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None) -> torch.Tensor:
        out, row = torch.empty_like(q), 0
        for slot, start, n in self._step:
            end = start + n
            self.k[layer, slot, start:end] = k[row:row + n]
            self.v[layer, slot, start:end] = v[row:row + n]
            lo = 0 if window is None else max(0, end - n - window + 1)
            keys = self.k[layer, slot, lo:end].to(q.dtype)  # [ctx, num_kv_heads, head_dim]
            vals = self.v[layer, slot, lo:end].to(q.dtype)
            if n == 1 or (start == 0 and window is None):
                mask = None  # one query sees all of [lo, end); a fresh prompt is plain causal
            else:
                mask = attention_mask(torch.arange(start, end), torch.arange(lo, end), window)
            out[row:row + n] = sdpa_gqa(q[row:row + n], keys, vals, mask, causal=n > 1)
            row += n
        return out
