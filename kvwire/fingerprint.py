"""Model fingerprint: what must be identical on both ends before a KV page is trusted.

Model config, weights, tokenizer and quantization mode are hashed or named; a KV page computed
by one model is meaningless to another, so decode refuses a mismatch with a readable diff.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from kvwire.config import ModelConfig
from kvwire.files import resolve_inside


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
    path = resolve_inside(Path(model_dir), "tokenizer.json")
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def fingerprint(model_dir: str | Path, cfg: ModelConfig, weights_sha256: str, quantization: str,
                weights_dtype: str) -> Fingerprint:
    return Fingerprint(model_name=Path(model_dir).name, architecture=cfg.architecture,
                       model_config_sha256=config_sha256(cfg), weights_sha256=weights_sha256,
                       tokenizer_sha256=tokenizer_sha256(model_dir), quantization=quantization,
                       weights_dtype=weights_dtype)
