"""Generating the Python stubs for the ``.proto`` files under ``protos/`` (CLI: ``python -m protos.generate``).

Equivalent to running, from the repository root::

    python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. protos/kvwire/v1/kvwire.proto

so the stubs import as ``from protos.kvwire.v1 import kvwire_pb2, kvwire_pb2_grpc``. The include
root is the repository root (not ``protos/``) so the generated modules live under ``protos.`` and
never shadow the ``kvwire`` library package. The stubs are git-ignored; ``import protos``
regenerates them when they are missing or older than their .proto. Files are written to a
temporary directory and moved into place, so two processes generating at once never see a
half-written module.
"""
from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent
# Paths relative to PROTO_DIR, without ".proto".
PROTOS = ("kvwire/v1/kvwire",)
_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _outputs(name: str) -> list[Path]:
    return [PROTO_DIR / f"{name}{s}" for s in _SUFFIXES]


def is_stale(name: str) -> bool:
    """True when a stub of ``protos/<name>.proto`` is missing or older than the .proto."""
    src = (PROTO_DIR / f"{name}.proto").stat().st_mtime
    return any(not p.exists() or p.stat().st_mtime < src for p in _outputs(name))


def generate(names: tuple[str, ...] = PROTOS) -> None:
    """Run protoc (grpcio-tools' bundled one) for each proto; raise RuntimeError if it fails."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory(dir=PROTO_DIR, prefix=".gen-") as tmp:
        for name in names:
            args = ["grpc_tools.protoc", f"-I{REPO_ROOT}", f"-I{well_known}",
                    f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                    str(PROTO_DIR / f"{name}.proto")]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed for protos/{name}.proto (see its output above)")
            for out in _outputs(name):
                os.replace(Path(tmp) / "protos" / out.relative_to(PROTO_DIR), out)


def ensure_generated() -> None:
    """Regenerate stale stubs; keep existing ones (with a warning) where protos/ is read-only."""
    stale = tuple(n for n in PROTOS if is_stale(n))
    if not stale:
        return
    try:
        generate(stale)
    except OSError as e:
        if not all(p.exists() for n in stale for p in _outputs(n)):
            raise
        warnings.warn(f"protos: stubs look older than their .proto but could not be regenerated "
                      f"({e}); using the existing ones", RuntimeWarning, stacklevel=2)
