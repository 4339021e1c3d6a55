"""What a model path names, torch-free: an HF directory (config.json + safetensors), a GGUF file
or a directory holding one, or a registered model name (see ``kvwire.model.registry``).

``load_config`` and ``eos_token_ids`` need neither weights in memory nor tokenizer files, so
prefill_svc and decode_svc start on a directory without tokenizer.json.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from kvwire.config import ConfigError, ModelConfig
from kvwire.files import LoadError, read_json, resolve_inside
from kvwire.model import gguf
from kvwire.model.registry import resolve_model_path


@dataclass(frozen=True)
class ModelSource:
    path: Path  # as resolved: a directory, or the GGUF file
    gguf: Path | None  # the GGUF file, when that is the format

    @property
    def dir(self) -> Path:
        """Where side files (generation_config.json, tokenizer_config.json) would be."""
        return self.gguf.parent if self.gguf is not None else self.path

    @property
    def name(self) -> str:
        return self.gguf.stem if self.gguf is not None else self.path.name


def model_source(path: str | Path) -> ModelSource:
    p = resolve_model_path(path)
    if not p.exists():
        raise LoadError(f"{p}: no such file or directory (expected a model directory, a .gguf file or "
                        "a registered model name)")
    found = gguf.find_gguf(p)
    if found is None and p.is_file():
        raise LoadError(f"{p}: not a model directory or a .gguf file")
    return ModelSource(path=found if found is not None else p, gguf=found)


def load_config(path: str | Path, reader=None) -> ModelConfig:
    src = model_source(path)
    try:
        if src.gguf is not None:
            reader = reader if reader is not None else gguf.open_gguf(src.gguf)
            return ModelConfig.from_hf(gguf.hf_config(reader, str(src.gguf)), str(src.gguf))
        if not (src.path / "config.json").is_file():
            raise LoadError(f"{src.path}: missing config.json (or a .gguf file)")
        return ModelConfig.from_hf(read_json(src.path, "config.json"), str(src.path / "config.json"))
    except ConfigError as e:
        raise LoadError(str(e)) from e


def eos_token_ids(path: str | Path, cfg: ModelConfig | None = None) -> frozenset[int]:
    """End-of-sequence ids from config.json, generation_config.json and a GGUF's metadata; and from
    tokenizer_config.json's eos_token when tokenizer.json is there to spell it."""
    src = model_source(path)
    cfg = cfg if cfg is not None else load_config(src.path)
    ids = set(cfg.eos_token_ids)
    gen = read_json(src.dir, "generation_config.json", required=False) or {}
    value = gen.get("eos_token_id")
    ids.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    if src.gguf is None and (src.path / "tokenizer.json").is_file():
        try:
            eos = _tokenizer_config_eos_id(src.path)
        except Exception:  # noqa: BLE001 - tokenizer files are optional here; config.json already spoke
            eos = None
        if eos is not None:
            ids.add(eos)
    return frozenset(ids)


def token_text(value) -> str | None:
    """A special token of tokenizer_config.json, written either as "<s>" or as {"content": "<s>", ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _tokenizer_config_eos_id(model_dir: Path) -> int | None:
    """tokenizer_config.json's eos_token as an id of tokenizer.json's vocabulary (as ModelTokenizer reads it)."""
    text = token_text((read_json(model_dir, "tokenizer_config.json", required=False) or {}).get("eos_token"))
    if not text:
        return None
    return Tokenizer.from_file(str(resolve_inside(model_dir, "tokenizer.json"))).token_to_id(text)
