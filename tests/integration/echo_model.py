"""A hand-built one-layer Llama that repeats its prompt: a real model that writes chosen text.

Used to send Korean, ZWJ emoji, CJK and combining marks through the whole stack as *generated*
tokens (a trained model would rarely write them). The checkpoint is ordinary HF format, loaded
by the real loader in every service.

Construction (hidden = head_dim = d, one head): every embedding has a constant 1 in dim 0 and
random values elsewhere. q and k read only dim 0, so they are the same fixed vectors u and
R(D*theta) u at every position; with RoPE the score between query p and key j is
sum_f |u_f|^2 cos((j - p + D) * theta_f), largest at j = p - D. The value is the normalised input
itself and o_proj scales it up, so the residual is dominated by the embedding of the token D
positions back, and the tied lm_head reads that token out. With the prompt [bos] + S and
D = len(S) - 1, the model continues with S again: token p+1 = token p+1-len(S).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer


def build_echo_model(out: Path, tokenizer_dir: Path, period: int, d: int = 128, theta: float = 20.0,
                     rope_factor: float = 0.25, amplitude: float = 6.0, copy_gain: float = 10.0,
                     seed: int = 0) -> Path:
    """``rope_factor`` < 1 ("linear" RoPE scaling) speeds every frequency up, so the score peak
    is sharp: for d=128, theta=20 the best wrong offset scores ~0.3 of the peak (30 nats below)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(vocab, d, generator=g)
    emb[:, 0] = 1.0  # the constant direction q and k are built from

    half = d // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d)) / rope_factor  # [half]
    u = torch.zeros(d)
    u[:half] = math.sqrt(amplitude)  # |u_f|^2 = amplitude in every rotation plane (f, f + half)
    # w = R(D * theta) u, plane by plane (rotate-half convention: x' = x cos + rot(x) sin)
    ang = (period - 1) * inv_freq
    w = torch.cat([u[:half] * torch.cos(ang), u[:half] * torch.sin(ang)])
    q_proj = torch.zeros(d, d)
    k_proj = torch.zeros(d, d)
    q_proj[:, 0], k_proj[:, 0] = u, w
    tensors = {
        "model.embed_tokens.weight": emb,
        "model.norm.weight": torch.ones(d),
        "model.layers.0.input_layernorm.weight": torch.ones(d),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(d),
        "model.layers.0.self_attn.q_proj.weight": q_proj,
        "model.layers.0.self_attn.k_proj.weight": k_proj,
        "model.layers.0.self_attn.v_proj.weight": torch.eye(d),
        "model.layers.0.self_attn.o_proj.weight": torch.eye(d) * copy_gain,
        "model.layers.0.mlp.gate_proj.weight": torch.zeros(d, d),
        "model.layers.0.mlp.up_proj.weight": torch.zeros(d, d),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(d, d),
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": d,
              "intermediate_size": d, "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
              "head_dim": d, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": theta,
              "rope_scaling": {"rope_type": "linear", "factor": rope_factor},
              "tie_word_embeddings": True, "hidden_act": "silu"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
