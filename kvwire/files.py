"""Reading files of a local model directory, torch-free (the tokenizer service imports this).

Paths are resolved inside the model directory: a name cannot escape through ``..`` or a symlink.
"""
from __future__ import annotations

import json
from pathlib import Path


class LoadError(ValueError):
    """A model directory that cannot be loaded; the message names file, tensor and expectation."""


def resolve_inside(model_dir: Path, name: str) -> Path:
    root = model_dir.resolve()
    path = (root / name).resolve()
    if path != root and root not in path.parents:
        raise LoadError(f"{name!r} resolves to {path}, outside the model directory {root}")
    return path


def read_json(model_dir: Path, name: str, required: bool = True) -> dict | None:
    path = resolve_inside(model_dir, name)
    if not path.is_file():
        if required:
            raise LoadError(f"{model_dir}: missing {name}")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise LoadError(f"{path}: not valid JSON ({e})") from e
