"""Load a model into ``Transformer``: a local Hugging Face directory (config.json + safetensors) or a
GGUF file (see ``kvwire.model.gguf``), whose tensors are dequantized one at a time.

Every failure names the file, the tensor and what was expected. Paths are resolved inside the
model directory: a name in an index file cannot escape through ``..`` or a symlink.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from kvwire.config import DType, ModelConfig
from kvwire.files import LoadError, read_json, resolve_inside
from kvwire.model import gguf
from kvwire.model.model import Transformer, rope_inv_freq
from kvwire.model.source import load_config, model_source

__all__ = ["LoadError", "LoadedModel", "load_config", "load_model"]

TORCH_DTYPES = {DType.FP32: torch.float32, DType.BF16: torch.bfloat16}
PROGRESS_MIN_BYTES = 64 << 20  # show a progress bar for checkpoints larger than this


def _open_safetensors(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own untyped errors for bad files
        raise LoadError(f"{path}: not a readable safetensors file ({e})") from e


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file, from the index when the checkpoint is sharded."""
    index = read_json(model_dir, "model.safetensors.index.json", required=False)
    if index is not None:
        wmap = index.get("weight_map")
        if not isinstance(wmap, dict):
            raise LoadError(f"{model_dir / 'model.safetensors.index.json'}: no 'weight_map' object")
        files = {name: resolve_inside(model_dir, f) for name, f in wmap.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise LoadError(f"{model_dir}: shard {f.name} named in model.safetensors.index.json is missing")
        return files
    single = resolve_inside(model_dir, "model.safetensors")
    if not single.is_file():
        raise LoadError(f"{model_dir}: missing model.safetensors (or model.safetensors.index.json)")
    with _open_safetensors(single) as f:
        return {name: single for name in f.keys()}


def hf_tensor_plan(cfg: ModelConfig) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Our parameter name -> the HF tensors (name, shape) concatenated along dim 0 to build it."""
    h, d, hkv, hid, inter = cfg.num_heads, cfg.head_dim, cfg.num_kv_heads, cfg.hidden_size, cfg.intermediate_size
    plan: dict[str, list[tuple[str, tuple[int, ...]]]] = {
        "embed.weight": [("model.embed_tokens.weight", (cfg.vocab_size, hid))],
        "norm.weight": [("model.norm.weight", (hid,))],
        "lm_head.weight": [("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight",
                            (cfg.vocab_size, hid))],
    }
    for i in range(cfg.num_layers):
        p, ours = f"model.layers.{i}.", f"layers.{i}."
        plan[ours + "attn.qkv.weight"] = [(p + "self_attn.q_proj.weight", (h * d, hid)),
                                          (p + "self_attn.k_proj.weight", (hkv * d, hid)),
                                          (p + "self_attn.v_proj.weight", (hkv * d, hid))]
        if cfg.attention_bias:
            plan[ours + "attn.qkv.bias"] = [(p + "self_attn.q_proj.bias", (h * d,)),
                                            (p + "self_attn.k_proj.bias", (hkv * d,)),
                                            (p + "self_attn.v_proj.bias", (hkv * d,))]
        plan[ours + "attn.o.weight"] = [(p + "self_attn.o_proj.weight", (hid, h * d))]
        plan[ours + "mlp.gate_up.weight"] = [(p + "mlp.gate_proj.weight", (inter, hid)),
                                             (p + "mlp.up_proj.weight", (inter, hid))]
        plan[ours + "mlp.down.weight"] = [(p + "mlp.down_proj.weight", (hid, inter))]
        plan[ours + "attn_norm.weight"] = [(p + "input_layernorm.weight", (hid,))]
        plan[ours + "mlp_norm.weight"] = [(p + "post_attention_layernorm.weight", (hid,))]
    return plan


@dataclass(frozen=True)
class LoadedModel:
    model: Transformer
    config: ModelConfig
    weights_sha256: str  # over tensor names, dtypes, shapes and bytes, in name order


def load_model(model_dir: str | Path, dtype: DType = DType.FP32, device: str = "cpu",
               progress: bool | None = None) -> LoadedModel:
    """``model_dir``: an HF directory, a .gguf file, a directory holding one, or a registered name."""
    src = model_source(model_dir)
    if src.gguf is not None:
        return _load_gguf(src.gguf, DType(dtype), device, progress)
    model_dir = src.path
    cfg = load_config(model_dir)
    files = weight_files(model_dir)
    plan = hf_tensor_plan(cfg)
    needed = sorted({name for parts in plan.values() for name, _ in parts})
    for name in needed:
        if name not in files:
            raise LoadError(f"{model_dir}: tensor {name!r} is missing from the checkpoint "
                            f"({', '.join(sorted({f.name for f in files.values()}))})")
    total = sum(os.path.getsize(f) for f in set(files.values()))
    show = total >= PROGRESS_MIN_BYTES if progress is None else progress
    tdtype = TORCH_DTYPES[DType(dtype)]

    sha = hashlib.sha256()
    tensors: dict[str, torch.Tensor] = {}
    handles = {f: _open_safetensors(f) for f in set(files.values())}
    try:
        for name in tqdm(needed, desc=f"loading {model_dir.name}", unit="tensor", disable=not show):
            t = handles[files[name]].get_tensor(name)
            sha.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            if t.numel():
                sha.update(t.contiguous().view(torch.uint8).numpy())  # no copy
            tensors[name] = t
    finally:
        handles.clear()

    state = {}
    for ours, parts in plan.items():
        pieces = []
        for name, shape in parts:
            t = tensors[name]
            if tuple(t.shape) != shape:
                raise LoadError(f"{files[name]}: tensor {name!r} has shape {tuple(t.shape)}, expected "
                                f"{shape} from config.json")
            # Norm weights and biases are tiny and stay fp32; matrices take the requested dtype.
            pieces.append(t.to(torch.float32 if t.dim() == 1 else tdtype))
        state[ours] = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
    return LoadedModel(model=_finish(cfg, state, device), config=cfg, weights_sha256=sha.hexdigest())


def _finish(cfg: ModelConfig, state: dict[str, torch.Tensor], device: str) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)  # built on "meta" above; make it real
    for p in model.parameters():
        p.requires_grad_(False)
    return model.to(device).eval()


def _load_gguf(path: Path, dtype: DType, device: str, progress: bool | None) -> LoadedModel:
    """Dequantize tensor by tensor (one float32 tensor alive at a time beside the model being built),
    undo llama.cpp's Q/K permutation, concatenate into our fused parameters in ``dtype``."""
    reader = gguf.open_gguf(path)
    cfg = load_config(path, reader)
    arch = gguf.field(reader, "general.architecture")
    tensors = {t.name: t for t in reader.tensors}
    plan = gguf.tensor_plan(cfg)
    expected = {name: shape for ours, parts in hf_tensor_plan(cfg).items()
                for name, shape in zip(plan[ours], (shape for _, shape in parts))}
    for name in sorted(expected):
        if name not in tensors:
            raise LoadError(f"{path}: tensor {name!r} is missing")
    show = os.path.getsize(path) >= PROGRESS_MIN_BYTES if progress is None else progress
    tdtype = TORCH_DTYPES[dtype]
    state: dict[str, torch.Tensor] = {}
    for ours, parts in tqdm(plan.items(), desc=f"loading {path.name}", unit="tensor", disable=not show):
        if ours == "lm_head.weight" and cfg.tie_word_embeddings:
            state[ours] = state["embed.weight"]  # one table, as a tied checkpoint means
            continue
        pieces = []
        for name in parts:
            w = gguf.dequantized(tensors[name], arch, cfg, str(path))
            if w.shape != expected[name]:
                raise LoadError(f"{path}: tensor {name!r} has shape {w.shape}, expected {expected[name]} "
                                "from the file's metadata")
            # Norm weights and biases are tiny and stay fp32; matrices take the requested dtype.
            pieces.append(torch.from_numpy(w).to(torch.float32 if w.ndim == 1 else tdtype))
            del w
        state[ours] = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        del pieces
    return LoadedModel(model=_finish(cfg, state, device), config=cfg, weights_sha256=gguf.weights_sha256(reader))
