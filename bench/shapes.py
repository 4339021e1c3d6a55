"""Random-weight models of real shapes, written locally in HF format (config.json + safetensors).

No download: the shapes are public numbers; the weights are seeded noise (std 0.02 like HF's init).
Both our loader and transformers load the result, so both engines run the same bytes.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

SHAPES = {
    "tinyllama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                           num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                           max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False),
    # For smoke tests only: builds in a blink.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, rope_theta=10000.0,
                 tie_word_embeddings=False),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
}


def build(name: str, out_root: Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """Write the model once under out_root/name and return its directory."""
    shape = SHAPES[name]
    out = out_root / name
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // heads
    g = torch.Generator().manual_seed(seed)

    def rnd(*s):  # noqa: E306
        return (torch.randn(*s, generator=g) * 0.02).to(dtype)

    tensors = {"model.embed_tokens.weight": rnd(shape["vocab_size"], h),
               "model.norm.weight": torch.ones(h, dtype=dtype)}
    if not shape["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rnd(shape["vocab_size"], h)
    for i in tqdm(range(shape["num_hidden_layers"]), desc=f"building {name}", unit="layer"):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": rnd(heads * d, h), p + "self_attn.k_proj.weight": rnd(kv * d, h),
                    p + "self_attn.v_proj.weight": rnd(kv * d, h), p + "self_attn.o_proj.weight": rnd(h, heads * d),
                    p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
                    p + "mlp.down_proj.weight": rnd(h, inter),
                    p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                    p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, head_dim=d,
                  torch_dtype="bfloat16" if dtype == torch.bfloat16 else "float32", **shape)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
