"""One Llama-family transformer (Llama, Mistral, Qwen2), read top to bottom.

A step is ``num_tokens`` flattened tokens of one or several sequences. The model computes q/k/v
and RoPE; where K/V live and which keys each query sees belong to the KV cache the caller prepared
(``KVCache``), so the dense reference cache and the paged FP8 cache plug in without touching the
math. No serving, gRPC or quantization imports: layers are ``kvwire.model.linear.Linear``.
"""
from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvwire.config import ModelConfig, RopeConfig
from kvwire.model.linear import Linear


class KVCache(Protocol):
    """What the model needs from a KV cache during one forward step."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None) -> torch.Tensor:
        """Store this step's K/V for ``layer`` and return attention output.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim], RoPE
        applied. A query at position p sees its own sequence's keys at positions j <= p (and
        j > p - window when window is set). Returns [num_tokens, num_heads, head_dim].
        """
        ...


# ---- RoPE -------------------------------------------------------------------------------------

def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    # On the CPU even inside the loader's meta-device context: arithmetic on meta tensors runs
    # torch's Python reference ops, which import torch._dynamo and Triton (~60 MB per process).
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if rope.kind == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq  # [head_dim // 2]


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [num_tokens, head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [num_tokens, 1, head_dim]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, heads, head_dim]; "rotate half" convention of HF Llama checkpoints.
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# ---- Blocks -----------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.window = layer, cfg.layer_windows[layer] if cfg.layer_windows else None
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # q, k and v projections fused into one matmul: rows [q | k | v].
        self.qkv = Linear(cfg.hidden_size, (self.h + 2 * self.hkv) * self.d, bias=cfg.attention_bias)
        self.o = Linear(self.h * self.d, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q = apply_rope(q.view(n, self.h, self.d), cos, sin)  # [num_tokens, num_heads, head_dim]
        k = apply_rope(k.view(n, self.hkv, self.d), cos, sin)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(n, self.hkv, self.d)
        out = cache.attend(self.layer, q, k, v, self.window)  # [num_tokens, num_heads, head_dim]
        return self.o(out.reshape(n, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # rows [gate | up]
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.inter, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, cache)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # nn.Embedding's random init on the loader's meta device would import torch._dynamo and
        # Triton (see rope_inv_freq), and the loader fills every weight anyway: init only real tensors.
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                  _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))  # [vocab, hidden]
        if not self.embed.weight.is_meta:
            nn.init.normal_(self.embed.weight)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim), persistent=False)
        # A fused implementation of decode steps (kvwire.model.fast_decode), set after loading and
        # quantization; it returns None for the steps it does not take, which then run below.
        self.step_fn = None
        self.last_hidden: torch.Tensor | None = None  # the last forward's final normed hidden state, its logits rows

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions: [num_tokens] int64. Returns fp32 logits [len(logits_rows) or num_tokens, vocab].

        Activations stay fp32 whatever the weights' dtype: this CPU has no bf16 arithmetic, and
        the residual stream keeps its precision.
        """
        if self.step_fn is not None:
            logits = self.step_fn(tokens, positions, cache, logits_rows)
            if logits is not None:
                return logits
        x = self.embed(tokens).float()  # [num_tokens, hidden]
        cos, sin = rope_cos_sin(self.inv_freq, positions)
        for block in self.layers:
            x = block(x, cos, sin, cache)
        if logits_rows is not None:
            x = x[logits_rows]  # [num_rows, hidden]
        self.last_hidden = self.norm(x)  # [num_rows, hidden]: what a draft head reads (kvwire.model.draft_head)
        return self.lm_head(self.last_hidden).float()  # [num_rows, vocab]
