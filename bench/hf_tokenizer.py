"""Tokenizer files for an exported HF directory, so a serving peer (vLLM) loads the model whole.

Method and details: bench/README.md, section ``bench/hf_tokenizer.py``.
"""
from __future__ import annotations

import json
from pathlib import Path

from bench.hf_weights import hf_dir
from kvwire.model import gguf
from kvwire.model.gguf_tokenizer import build_tokenizer
from kvwire.model.source import model_source

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def export_tokenizer(model_path: str | Path, out: Path) -> Path:
    """Write TOKENIZER_FILES for ``model_path``'s GGUF tokenizer into ``out`` (kept when present)."""
    src = model_source(model_path)
    if src.gguf is None:
        raise ValueError(f"{model_path}: not a GGUF source; an HF directory carries its own tokenizer")
    out.mkdir(parents=True, exist_ok=True)
    if all((out / f).is_file() for f in TOKENIZER_FILES):
        return out
    reader = gguf.open_gguf(src.gguf)
    built = build_tokenizer(reader, str(src.gguf))
    max_len = gguf.field(reader, f"{gguf.field(reader, 'general.architecture')}.context_length")
    add_bos = bool(gguf.field(reader, "tokenizer.ggml.add_bos_token", False))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": built.bos_token, "eos_token": built.eos_token,
        "add_bos_token": add_bos, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(max_len) if isinstance(max_len, int) else 8192,
    }
    if built.chat_template:
        config["chat_template"] = built.chat_template
    eos = sorted(gguf.eos_token_ids(reader))
    tok = built.tokenizer
    gen = {"eos_token_id": eos if len(eos) != 1 else eos[0]}
    if built.bos_token is not None:
        gen["bos_token_id"] = tok.token_to_id(built.bos_token)
    tok.save(str(out / "tokenizer.json.tmp"))
    (out / "tokenizer.json.tmp").rename(out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


def hf_model_dir(model_path: str | Path) -> Path:
    """``hf_dir(model_path)`` with tokenizer files added (an HF source directory is returned as is)."""
    out = hf_dir(model_path)
    if model_source(model_path).gguf is not None:
        export_tokenizer(model_path, out)
    return out
