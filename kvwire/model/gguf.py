"""GGUF checkpoints (llama.cpp's single-file format), read with the ``gguf`` package; torch-free.

Where a GGUF is (a ``.gguf`` path or a directory holding exactly one), how its metadata maps onto a
Hugging Face ``config.json`` and its tensor names onto ours, and one stored tensor as float32
(dequantized, llama.cpp's Q/K row permutation undone), so the loader holds one fp32 tensor at a time.
"""
from __future__ import annotations

import functools
import hashlib
import mmap
from pathlib import Path
from typing import Any

import numpy as np

from kvwire.files import LoadError

SUFFIX = ".gguf"
# The architectures whose tensors we can place (general.architecture -> HF class).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# llama.cpp's convert_hf_to_gguf.py interleaves the rows of Q and K for these (HF checkpoints use
# the "rotate half" RoPE layout, llama.cpp's kernels the interleaved one); Qwen2 is stored as is.
PERMUTED_QK = {"llama", "mistral"}
# Tensor types covered by tests against transformers' own GGUF loading; gguf can dequantize more.
TESTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
LOADABLE_TYPES = TESTED_TYPES + ("Q5_0", "Q5_1", "Q2_K", "Q3_K")


def find_gguf(path: Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the one ``*.gguf`` in a directory that has
    no config.json (an HF directory with a stray GGUF stays an HF directory)."""
    if path.is_file():
        return path if path.suffix.lower() == SUFFIX else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
    if len(found) > 1:
        raise LoadError(f"{path}: holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); "
                        "pass the one to load as the path")
    return found[0] if found else None


def open_gguf(path: Path):
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped), or a LoadError naming the file. Parsing the
    metadata of a real model takes seconds, so the reader of the last few files is kept."""
    st = path.stat()
    return _open(str(path.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _open(path_str: str, mtime_ns: int, size: int):
    path = Path(path_str)
    try:
        from gguf import GGUFReader
    except ImportError as e:  # a runtime dependency; only a broken install gets here
        raise LoadError(f"{path}: reading GGUF files needs the 'gguf' package ({e})") from e

    class PlainReader(GGUFReader):
        # The reader slices its np.memmap about once per vocabulary entry field, and each memmap slice
        # pays Python-level bookkeeping; a plain ndarray view of the same mapping parses faster
        # (see docs/decisions/042-bf16-linear-and-loading.md).
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):
            self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    if "-of-" in path.stem and path.stem.rsplit("-of-", 1)[-1].isdigit():
        raise LoadError(f"{path}: split GGUF files are not supported; merge them with llama.cpp's "
                        "llama-gguf-split --merge first")
    try:
        return PlainReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise LoadError(f"{path}: not a readable GGUF file ({e})") from e


def field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value.item() if isinstance(value, np.generic) else value


def hf_config(reader, source: str) -> dict[str, Any]:
    """The metadata as a Hugging Face config.json dict, for ``ModelConfig.from_hf``."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise LoadError(f"{source}: GGUF architecture {arch!r} is not supported; supported: "
                        f"{', '.join(ARCHITECTURES)}")
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise LoadError(f"{source}: tensor 'token_embd.weight' is missing")

    def meta(key: str, default: Any = None) -> Any:
        return field(reader, f"{arch}.{key}", default)

    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    for key, value in (("embedding_length", hidden), ("attention.head_count", heads)):
        if not isinstance(value, int) or value <= 0:
            raise LoadError(f"{source}: metadata {arch}.{key} must be a positive integer, got {value!r}")
    head_dim = meta("attention.key_length") or hidden // heads
    rot = meta("rope.dimension_count", head_dim)
    if rot != head_dim:
        raise LoadError(f"{source}: partial rotary embeddings ({arch}.rope.dimension_count {rot} < head "
                        f"dim {head_dim}) are not supported")
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": int(names["token_embd.weight"].shape[-1]),  # GGUF shapes are [cols, rows]
        "hidden_size": hidden, "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads), "head_dim": head_dim,
        "max_position_embeddings": meta("context_length", 2048),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": sorted(eos_token_ids(reader)) or None,
    }
    window = meta("attention.sliding_window")
    if window and arch != "qwen2":  # llama.cpp runs qwen2 with full attention whatever the file says
        cfg["sliding_window"] = int(window)
    scaling = meta("rope.scaling.type") or ("linear" if meta("rope.scale_linear") else None)
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear",
                               "factor": float(meta("rope.scaling.factor") or meta("rope.scale_linear"))}
    elif scaling not in (None, "none"):
        raise LoadError(f"{source}: RoPE scaling {scaling!r} is not supported (supported: none, linear)")
    if "rope_freqs.weight" in names:
        raise LoadError(f"{source}: per-frequency RoPE factors (tensor 'rope_freqs.weight', Llama 3.1 style) "
                        "are not supported for GGUF files; load the HF checkpoint instead")
    return cfg


# Control tokens llama.cpp also ends generation on (llama-vocab.cpp's end-of-generation list).
END_OF_GENERATION_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                           "<|eom_id|>", "<EOT>", "</s>")


def eos_token_ids(reader) -> set[int]:
    ids = {field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")}
    types, tokens = reader.fields.get("tokenizer.ggml.token_type"), reader.fields.get("tokenizer.ggml.tokens")
    if types is not None and tokens is not None:
        control = np.flatnonzero(np.asarray(types.contents()) == 3)  # 3: CONTROL
        ids.update(int(i) for i in control if tokens.contents(int(i)) in END_OF_GENERATION_TEXTS)
    return {int(i) for i in ids if i is not None}


def tokenizer_sha256(reader) -> str:
    """Hash of every ``tokenizer.*`` metadata field, as stored (keys, types and values)."""
    sha = hashlib.sha256()
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            size = sum(p.nbytes for p in f.parts)
            sha.update(memoryview(np.ascontiguousarray(reader.data[f.offset:f.offset + size])))
    return sha.hexdigest()


def weights_sha256(reader) -> str:
    """Hash of every tensor's name, type, shape and stored (still quantized) bytes, in name order."""
    sha = hashlib.sha256()
    for t in sorted(reader.tensors, key=lambda t: t.name):
        sha.update(f"{t.name}:{t.tensor_type.name}:{tuple(int(n) for n in t.shape)}".encode())
        sha.update(memoryview(np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)))
        release_pages(reader)
    return sha.hexdigest()


def forget_readers() -> None:
    """Drop the kept readers (``open_gguf``). A service calls this once its model, tokenizer facts
    and fingerprint are loaded: SmolLM2's parsed 49k-token vocabulary held ~43 MB of the process otherwise."""
    _open.cache_clear()


def release_pages(reader) -> None:
    """Unmap the pages of the file read so far through ``reader``'s memory map (they stay in the
    page cache; a later read maps them again). A kept reader (``open_gguf``) would otherwise hold
    every page the loader touched, the whole file, in the process's resident set for good."""
    base = getattr(reader, "data", None)
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None) if not isinstance(base, memoryview) else base.obj
    if base is not None and hasattr(base, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        try:
            base.madvise(mmap.MADV_DONTNEED)  # read-only private map: nothing to lose
        except (OSError, ValueError):
            pass  # an advisory call; without it only RSS accounting differs


def tensor_plan(cfg) -> dict[str, list[str]]:
    """Our parameter name -> the GGUF tensors concatenated along dim 0 to build it."""
    plan = {"embed.weight": ["token_embd.weight"], "norm.weight": ["output_norm.weight"],
            "lm_head.weight": ["token_embd.weight" if cfg.tie_word_embeddings else "output.weight"]}
    for i in range(cfg.num_layers):
        b, ours = f"blk.{i}.", f"layers.{i}."
        plan[ours + "attn.qkv.weight"] = [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"]
        if cfg.attention_bias:
            plan[ours + "attn.qkv.bias"] = [b + "attn_q.bias", b + "attn_k.bias", b + "attn_v.bias"]
        plan[ours + "attn.o.weight"] = [b + "attn_output.weight"]
        plan[ours + "mlp.gate_up.weight"] = [b + "ffn_gate.weight", b + "ffn_up.weight"]
        plan[ours + "mlp.down.weight"] = [b + "ffn_down.weight"]
        plan[ours + "attn_norm.weight"] = [b + "attn_norm.weight"]
        plan[ours + "mlp_norm.weight"] = [b + "ffn_norm.weight"]
    return plan


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's ``permute``: rows [n_head, 2, d/2] were stored as [n_head, d/2, 2]."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantized(reader_tensor, arch: str, cfg, source: str) -> np.ndarray:
    """One tensor as float32 in PyTorch's [rows, cols] order, Q/K rows in HF order."""
    from gguf.quants import dequantize

    t = reader_tensor
    kind = t.tensor_type.name
    if kind not in LOADABLE_TYPES:
        raise LoadError(f"{source}: tensor {t.name!r} has type {kind}, which is not supported "
                        f"(supported: {', '.join(LOADABLE_TYPES)})")
    try:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    except (ValueError, NotImplementedError) as e:
        raise LoadError(f"{source}: cannot dequantize tensor {t.name!r} ({kind}): {e}") from e
    if not w.flags.writeable:  # F32 comes back as a view of the read-only memory map
        w = w.copy()
    shape = tuple(int(n) for n in reversed(t.shape))
    if w.shape != shape:  # the reader's numpy view drops size-1 dims; restore the stated shape
        w = w.reshape(shape)
    if arch in PERMUTED_QK and (".attn_q." in t.name or ".attn_k." in t.name):
        w = unpermute_qk(w, cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads)
    return w


def tensor_type(reader_tensor) -> str:
    return reader_tensor.tensor_type.name


def raw_rows(reader_tensor, arch: str, cfg) -> np.ndarray:
    """One quantized matrix's blocks as stored, uint8 [rows, bytes per row], Q/K rows in HF order:
    rows are independent runs of blocks, so undoing the permutation moves whole rows (exact)."""
    t = reader_tensor
    w = np.asarray(t.data).reshape(int(t.shape[-1]), -1)  # [rows, row bytes], a view of the memory map
    if arch in PERMUTED_QK and (".attn_q." in t.name or ".attn_k." in t.name):
        w = unpermute_qk(w, cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads)
    return np.ascontiguousarray(w)  # a copy: the layer keeps it after the file's pages are released
