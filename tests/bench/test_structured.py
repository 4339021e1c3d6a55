"""bench structured end to end in a tiny configuration (no speed is asserted): both grammar engines
walk the schema's document, and the plain requests' tokens are unchanged beside a constrained one."""
from __future__ import annotations

import json

import pytest

from bench import __main__ as cli
from kvwire.config import DEFAULT_MODEL_DIR

pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")


def test_structured(tmp_path):
    cli.main(["structured", "--model", str(DEFAULT_MODEL_DIR), "--weights", "none", "--batch", "2", "--steps", "4",
              "--compiles", "1", "--rounds", "1", "--out", str(tmp_path)])
    [path] = tmp_path.glob("structured-*.json")
    report = json.loads(path.read_text())
    assert set(report["backends"]) == {"xgrammar", "llguidance"}
    assert all(b["mask_us"]["n"] == b["tokens"] for b in report["backends"].values())
    assert report["engine"]["neighbours_unchanged"] is True
    assert all(r["step_ms"]["n"] > 0 for r in report["engine"]["rows"].values())
