"""Load a model into ``Transformer``: a local Hugging Face directory (config.json + safetensors) or a
GGUF file (see ``kvwire.model.gguf``), whose tensors are dequantized one at a time.

Every failure names the file, the tensor and what was expected. Paths are resolved inside the
model directory: a name in an index file cannot escape through ``..`` or a symlink.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from kvwire.config import DType, ModelConfig
from kvwire.files import LoadError, read_json, resolve_inside
from kvwire.model import gguf
from kvwire.model.gguf_linear import NATIVE_TYPES, GGUFEmbedding, GGUFLinear, GGUFRows, native_shape
from kvwire.model.linear import Linear
from kvwire.model.model import Transformer, rope_inv_freq
from kvwire.model.source import load_config, model_source
from kvwire.model.tuned import TRIM_EVERY_BYTES

__all__ = ["LoadError", "LoadedModel", "load_config", "load_model"]

log = logging.getLogger(__name__)

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


# quantize(module path, pieces) -> the layer to install there, or None to load a plain Linear.
# pieces: the checkpoint tensors ([rows_i, in], their stored float dtype, on the target device)
# whose concatenation along dim 0 is the fused weight; the layer is built without bias (the loader
# sets ``layer.bias``, fp32, when the checkpoint has one). See kvwire.model.quant.load_quantizer.
Quantize = Callable[[str, Sequence[torch.Tensor]], "nn.Module | None"]


def load_model(model_dir: str | Path, dtype: DType = DType.FP32, device: str = "cpu",
               progress: bool | None = None, quantize: Quantize | None = None,
               gguf_blocks: bool = False) -> LoadedModel:
    """``model_dir``: an HF directory, a .gguf file, a directory holding one, or a registered name.

    Tensors are read one at a time and each fused parameter is built as soon as its pieces are in,
    so the checkpoint is never held whole beside the model. With ``quantize``, every Linear it
    claims is built from the pieces directly: no float copy of that matrix is ever made.
    ``gguf_blocks`` (a GGUF on the CPU or a CUDA device): every Linear whose tensors are of types in
    ``gguf_linear.NATIVE_TYPES`` becomes a ``GGUFLinear`` on the file's blocks (``GGUFRows`` where its
    parts differ in type); the others take the ``quantize`` path, and the loader logs which.
    """
    src = model_source(model_dir)
    if src.gguf is not None:
        blocks = gguf_blocks and (device == "cpu" or device.startswith("cuda"))  # C kernels or Triton
        return _load_gguf(src.gguf, DType(dtype), device, progress, quantize, blocks)
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
    builder = _Builder(cfg, TORCH_DTYPES[DType(dtype)], device, quantize)
    # Checkpoint tensor -> our parameters that take it, and what each parameter still waits for.
    users: dict[str, list[str]] = {}
    for ours, parts in plan.items():
        for name, _ in parts:
            users.setdefault(name, []).append(ours)
    waiting = {ours: {name for name, _ in parts} for ours, parts in plan.items()}
    expected = {name: shape for parts in plan.values() for name, shape in parts}

    sha = hashlib.sha256()
    pending: dict[str, torch.Tensor] = {}  # read, not yet used by every parameter that needs it
    # Name order, as the hash wants; a parameter is built once its last piece is read. Each tensor
    # comes from a fresh handle: a handle's memory map keeps every page read through it resident
    # (counted in RSS) until it is closed, which for one handle would be the whole checkpoint.
    for name in tqdm(needed, desc=f"loading {model_dir.name}", unit="tensor", disable=not show):
        with _open_safetensors(files[name]) as handle:
            t = handle.get_tensor(name)
        sha.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        if t.numel():
            sha.update(t.contiguous().view(torch.uint8).numpy())  # no copy
        if tuple(t.shape) != expected[name]:
            raise LoadError(f"{files[name]}: tensor {name!r} has shape {tuple(t.shape)}, expected "
                            f"{expected[name]} from config.json")
        pending[name] = t
        del t, handle
        for ours in users[name]:
            waiting[ours].discard(name)
            if not waiting[ours]:
                builder.add(ours, [pending[n] for n, _ in plan[ours]])
        for n in [n for n in pending if all(not waiting[o] for o in users[n])]:
            del pending[n]
    return LoadedModel(model=builder.finish(), config=cfg, weights_sha256=sha.hexdigest())


# glibc keeps freed blocks of up to 32 MB (the loader's temporaries) in its heap, where layers built
# between them can pin them, so freed pages are handed back (malloc_trim) every TRIM_EVERY_BYTES of
# parameters built; see docs/decisions/042-bf16-linear-and-loading.md.


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return None


def _return_freed_memory() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class _Builder:
    """Assembles a Transformer parameter by parameter: a meta-device model whose parameters are
    assigned at the end, and layers ``quantize`` builds installed as they come."""

    def __init__(self, cfg: ModelConfig, tdtype: torch.dtype, device: str, quantize: Quantize | None):
        self.cfg, self.tdtype, self.device, self.quantize = cfg, tdtype, device, quantize
        with torch.device("meta"):
            self.model = Transformer(cfg)
        self.state: dict[str, torch.Tensor] = {}
        self.installed: dict[str, nn.Module] = {}
        self.untrimmed = 0  # bytes of parameters built since freed memory was last handed back

    def install(self, mod_name: str, layer: nn.Module) -> None:
        """Put ``layer`` (built by the caller, without bias) in place of the Linear ``mod_name``."""
        parent, _, child = mod_name.rpartition(".")
        setattr(self.model.get_submodule(parent) if parent else self.model, child, layer)
        self.installed[mod_name] = layer

    def add(self, ours: str, pieces: list[torch.Tensor], tied: str | None = None) -> None:
        """Build parameter ``ours`` from ``pieces`` (concatenated along dim 0); ``tied``: it is
        the already built parameter of that name (one table, as a tied checkpoint means)."""
        self._add(ours, pieces, tied)
        self.untrimmed += sum(p.numel() * p.element_size() for p in pieces)
        if self.untrimmed >= TRIM_EVERY_BYTES:
            _return_freed_memory()
            self.untrimmed = 0

    def _add(self, ours: str, pieces: list[torch.Tensor], tied: str | None) -> None:
        mod_name, _, kind = ours.rpartition(".")
        if tied is not None:
            pieces = [self.state[tied]]
        if (self.quantize is not None and kind == "weight" and pieces[0].dim() == 2
                and isinstance(self.model.get_submodule(mod_name), Linear)):
            layer = self.quantize(mod_name, [p.to(self.device) for p in pieces])
            if layer is not None:
                self.install(mod_name, layer)
                return
        if tied is not None:
            self.state[ours] = self.state[tied]
            return
        # Norm weights and biases are tiny and stay fp32; matrices take the requested dtype.
        pieces = [p.to(torch.float32 if p.dim() == 1 else self.tdtype) for p in pieces]
        self.state[ours] = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)

    def finish(self) -> Transformer:
        model = self.model
        for mod_name, layer in self.installed.items():
            bias = self.state.pop(f"{mod_name}.bias", None)
            if bias is not None:
                layer.bias = bias.to(self.device)  # fp32, as Int8Linear / Fp8Linear keep it
            self.state.update({f"{mod_name}.{k}": v for k, v in layer.state_dict().items()})
        model.load_state_dict(self.state, strict=True, assign=True)
        self.state.clear()
        _return_freed_memory()
        model.inv_freq = rope_inv_freq(self.cfg.rope, self.cfg.head_dim)  # built on "meta"; make it real
        for p in model.parameters():
            p.requires_grad_(False)
        return model.to(self.device).eval()


def _gguf_layer(tensors: list, shapes: list[tuple[int, int]], arch: str, cfg) -> nn.Module | None:
    """The layer on the file's blocks for the concatenation of ``tensors`` (their rows in order), or
    None where a part has no native kernel: one GGUFLinear per run of parts of one type."""
    runs: list[tuple[str, list]] = []
    for t in tensors:
        kind = gguf.tensor_type(t)
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(t)
        else:
            runs.append((kind, [t]))
    cols, rows = shapes[0][1], [s[0] for s in shapes]
    sizes, at = [], 0
    for kind, ts in runs:
        sizes.append(sum(rows[at:at + len(ts)]))
        at += len(ts)
    if not all(kind in NATIVE_TYPES and native_shape(kind, n, cols) for (kind, _), n in zip(runs, sizes)):
        return None
    parts = [GGUFLinear(torch.from_numpy(np.concatenate([gguf.raw_rows(t, arch, cfg) for t in ts])), kind, cols)
             for kind, ts in runs]
    return parts[0] if len(parts) == 1 else GGUFRows(parts)


def _load_gguf(path: Path, dtype: DType, device: str, progress: bool | None,
               quantize: Quantize | None, blocks: bool = False) -> LoadedModel:
    """Dequantize tensor by tensor (one float32 tensor alive at a time beside the model being built),
    undo llama.cpp's Q/K permutation, concatenate into our fused parameters in ``dtype``. With
    ``blocks``, Linears of native types keep the file's blocks instead (``GGUFLinear``, ``GGUFRows``)."""
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
    builder = _Builder(cfg, TORCH_DTYPES[dtype], device, quantize)
    converted: dict[str, str] = {}  # Linear -> its tensor types, where blocks were asked for but not kept
    for ours, parts in tqdm(plan.items(), desc=f"loading {path.name}", unit="tensor", disable=not show):
        mod_name, _, kind = ours.rpartition(".")
        if blocks and kind == "weight" and isinstance(builder.model.get_submodule(mod_name), Linear):
            layer = _gguf_layer([tensors[n] for n in parts], [expected[n] for n in parts], arch, cfg)
            if layer is not None:
                builder.install(mod_name, layer)
                gguf.release_pages(reader)
                continue
            converted[mod_name] = "+".join(sorted({gguf.tensor_type(tensors[n]) for n in parts}))
        if blocks and ours == "embed.weight" and gguf.tensor_type(tensors[parts[0]]) in NATIVE_TYPES:
            t = tensors[parts[0]]  # the table stays in blocks; a lookup dequantizes the rows it needs
            builder.install("embed", GGUFEmbedding(torch.from_numpy(gguf.raw_rows(t, arch, cfg).copy()), gguf.tensor_type(t),
                                                   cfg.hidden_size))
            gguf.release_pages(reader)
            continue
        if ours == "lm_head.weight" and cfg.tie_word_embeddings:
            if isinstance(builder.installed.get("embed"), GGUFEmbedding):  # (a native LM head was built above)
                builder.add(ours, [builder.installed["embed"].dequantized_weight()])
                continue
            builder.add(ours, [], tied="embed.weight")
            continue
        pieces = []
        for name in parts:
            w = gguf.dequantized(tensors[name], arch, cfg, str(path))
            if w.shape != expected[name]:
                raise LoadError(f"{path}: tensor {name!r} has shape {w.shape}, expected {expected[name]} "
                                "from the file's metadata")
            pieces.append(torch.from_numpy(w))
            del w
        builder.add(ours, pieces)
        del pieces
        gguf.release_pages(reader)  # the file's pages read so far leave the resident set
    if converted:
        kept = sum(isinstance(m, (GGUFLinear, GGUFRows)) for m in builder.installed.values())
        log.info("%s: %d of %d linear layers have no native GGUF kernel and were dequantized: %s", path.name,
                 len(converted), len(converted) + kept,
                 ", ".join(f"{m} ({t})" for m, t in converted.items()))
    return LoadedModel(model=builder.finish(), config=cfg, weights_sha256=gguf.weights_sha256(reader))
