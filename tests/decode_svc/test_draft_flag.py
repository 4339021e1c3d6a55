"""decode_svc loads a draft model only when asked: --draft-model-dir, or --speculative draft (then the
``<model-dir>-draft`` directory beside the model, which must exist). Serving any other model with
the defaults never touches the embedded draft."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvwire.engine.build import draft_path as build_draft_path
from kvwire.config import DEFAULT_MODEL_DIR
from kvwire.files import LoadError


def args(model_dir: Path, speculative: str = "none", draft_model_dir: str | None = None) -> tuple:
    return model_dir, speculative, draft_model_dir


def draft_path(a: tuple) -> Path | None:
    return build_draft_path(*a)


def test_no_draft_by_default_even_beside_the_embedded_pair(tmp_path):
    sibling = DEFAULT_MODEL_DIR.parent / f"{DEFAULT_MODEL_DIR.name}-draft"
    assert sibling.is_dir()  # the embedded pair is there...
    assert draft_path(args(DEFAULT_MODEL_DIR)) is None  # ...and is not loaded unless asked for
    assert draft_path(args(tmp_path / "other-model")) is None
    assert draft_path(args(DEFAULT_MODEL_DIR, speculative="ngram")) is None


def test_speculative_draft_takes_the_sibling_or_says_what_to_pass(tmp_path):
    assert draft_path(args(DEFAULT_MODEL_DIR, speculative="draft")) == \
        DEFAULT_MODEL_DIR.parent / f"{DEFAULT_MODEL_DIR.name}-draft"
    (tmp_path / "other-model").mkdir()
    with pytest.raises(LoadError, match="--draft-model-dir"):
        draft_path(args(tmp_path / "other-model", speculative="draft"))


def test_explicit_flag_wins(tmp_path):
    assert draft_path(args(tmp_path / "m", draft_model_dir=str(tmp_path / "d"))) == tmp_path / "d"
    assert draft_path(args(DEFAULT_MODEL_DIR, speculative="draft", draft_model_dir="")) is None
