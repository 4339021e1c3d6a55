"""The library never imports gRPC, the protos or the services: remote KV sources, servers and
their plumbing are injected from above (decode_svc, kvwire_serving)."""
import pkgutil
import subprocess
import sys
from pathlib import Path

import kvwire

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("grpc", "grpc_health", "grpc_reflection", "protos", "kvwire_serving", "decode_svc", "prefill_svc",
             "tokenizer_svc")


def test_every_library_module_imports_without_grpc_protos_or_services():
    modules = sorted(m.name for m in pkgutil.walk_packages(kvwire.__path__, "kvwire."))
    assert "kvwire.engine.kv_source" in modules and "kvwire.engine.async_engine" in modules
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"the library imported {out.stdout.strip()}"
