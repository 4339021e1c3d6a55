"""An HF directory (config.json + model.safetensors) of any model path we load, for transformers peers.

transformers cannot read every source we load (a registered name's GGUF, Q4_1 weights), so a peer
gets the weights *our loader produced*: every fused parameter split back into the HF tensors it
was built from (``kvwire.model.loader.hf_tensor_plan``), float32. An HF directory is used as is.
Written once under bench/.models/hf/<name>-<sha12> (git-ignored), keyed by the weights' sha256.
"""
from __future__ import annotations

import json
from pathlib import Path

from bench.common import MODELS
from kvwire.model import gguf
from kvwire.model.source import model_source


def hf_dir(model_path: str | Path) -> Path:
    """``model_path`` itself when it is an HF directory, else the exported directory."""
    src = model_source(model_path)
    if src.gguf is None:
        return src.path
    reader = gguf.open_gguf(src.gguf)
    out = MODELS / "hf" / f"{src.name}-{gguf.weights_sha256(reader)[:12]}"
    if (out / "model.safetensors").is_file():
        return out
    return export(src.gguf, out, gguf.hf_config(reader, str(src.gguf)))


def export(path: Path, out: Path, config: dict) -> Path:
    # torch only here: hf_dir of an HF directory stays torch-free for the serve-vs-vllm parent process.
    import torch
    from safetensors.torch import save_file

    from kvwire.model.loader import hf_tensor_plan, load_model
    loaded = load_model(path)
    state = loaded.model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for ours, parts in hf_tensor_plan(loaded.config).items():
        if ours == "lm_head.weight" and loaded.config.tie_word_embeddings:
            continue
        for (name, shape), piece in zip(parts, state[ours].split([s[0] for _, s in parts], dim=0)):
            assert tuple(piece.shape) == shape, (name, piece.shape, shape)
            tensors[name] = piece.to(torch.float32).contiguous().clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors.tmp"), metadata={"format": "pt"})
    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
    config = {**config, "model_type": model_type[config["architectures"][0]], "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "model.safetensors.tmp").rename(out / "model.safetensors")
    return out
