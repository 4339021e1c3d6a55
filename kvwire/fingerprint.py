"""Model fingerprint: what must be identical on both ends before a KV page is trusted.

Model config, weights, tokenizer and quantization mode are hashed or named (for a GGUF source:
its stored tensors, and its tokenizer metadata); a KV page computed
by one model is meaningless to another, so decode refuses a mismatch with a readable diff.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from kvwire.config import ModelConfig
from kvwire.files import resolve_inside
from kvwire.model import gguf
from kvwire.model.source import model_source


@dataclass(frozen=True)
class Fingerprint:
    model_name: str
    architecture: str
    model_config_sha256: str
    weights_sha256: str
    tokenizer_sha256: str
    quantization: str
    weights_dtype: str

    def diff(self, other: "Fingerprint") -> list[str]:
        a, b = asdict(self), asdict(other)
        return [f"{k}: {a[k]!r} != {b[k]!r}" for k in a if a[k] != b[k] and k != "model_name"]


def config_sha256(cfg: ModelConfig) -> str:
    return hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True, default=str).encode()).hexdigest()


def tokenizer_sha256(model_dir: str | Path) -> str:
    """tokenizer.json's bytes for an HF directory; every ``tokenizer.*`` metadata field for a GGUF."""
    src = model_source(model_dir)
    if src.gguf is not None:
        return gguf.tokenizer_sha256(gguf.open_gguf(src.gguf))
    path = resolve_inside(src.path, "tokenizer.json")
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def fingerprint(model_dir: str | Path, cfg: ModelConfig, weights_sha256: str, quantization: str,
                weights_dtype: str) -> Fingerprint:
    return Fingerprint(model_name=model_source(model_dir).name, architecture=cfg.architecture,
                       model_config_sha256=config_sha256(cfg), weights_sha256=weights_sha256,
                       tokenizer_sha256=tokenizer_sha256(model_dir), quantization=quantization,
                       weights_dtype=weights_dtype)
