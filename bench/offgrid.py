"""A float checkpoint of a quantized model whose weights are off its 4-bit grid, the function unchanged.

    python -m bench.offgrid smollm2-135m-instruct [--sigma 0.3] [--seed 0]   # prints the directory

The only real model here ships as Q4_1: its dequantized weights lie on a 4-bit grid of groups of 32,
which 4-bit rounding with the same groups reproduces almost exactly. This folds a random per-input-
channel factor r = exp(N(0, sigma)) into every block Linear and its inverse into the op before it
(``kvwire.model.awq.fold``: RMSNorm weights, V rows, up rows; exact in float), so the model computes
the same outputs while its weights take continuous values, as a bf16 checkpoint's do. Written once
(fp32, with the GGUF's tokenizer as tokenizer.json) under bench/.models/hf/ (git-ignored).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.common import MODELS
from bench.hf_weights import hf_dir
from kvwire.model import awq
from kvwire.model.loader import hf_tensor_plan, load_model
from kvwire.model.registry import resolve_model_path
from kvwire.tokenizer import ModelTokenizer


def offgrid_dir(model_path: str | Path, sigma: float = 0.3, seed: int = 0) -> Path:
    src = hf_dir(resolve_model_path(model_path))
    out = MODELS / "hf" / f"{src.name}-offgrid{sigma}-s{seed}"
    if (out / "model.safetensors").is_file():
        return out
    loaded = load_model(src)
    model, cfg = loaded.model, loaded.config
    gen = torch.Generator().manual_seed(seed)
    scales = {}
    for i in range(cfg.num_layers):
        for name in awq.BLOCK_LINEARS:
            lin = model.get_submodule(f"layers.{i}.{name}")
            r = torch.exp(sigma * torch.randn(lin.in_features, generator=gen))
            if name == "attn.o":  # one factor per kv-head channel, shared by its query heads (V rows take 1 / r)
                per = cfg.num_heads // cfg.num_kv_heads
                r = r.view(cfg.num_kv_heads, per, cfg.head_dim)[:, :1].expand(-1, per, -1).reshape(-1)
            scales[f"layers.{i}.{name}"] = r
    awq.fold(model, cfg, scales)
    state = model.state_dict()
    tensors = {}
    for ours, parts in hf_tensor_plan(cfg).items():
        if ours == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        for (name, _), piece in zip(parts, state[ours].split([s[0] for _, s in parts], dim=0)):
            tensors[name] = piece.to(torch.float32).contiguous().clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors.tmp"), metadata={"format": "pt"})
    (out / "config.json").write_text((src / "config.json").read_text())
    tok = ModelTokenizer(model_path)
    tok.tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": tok.bos_token, "eos_token": tok.eos_token}))
    (out / "model.safetensors.tmp").rename(out / "model.safetensors")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.offgrid", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--sigma", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(offgrid_dir(args.model, args.sigma, args.seed))


if __name__ == "__main__":
    main()
