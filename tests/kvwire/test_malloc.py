"""kvwire.malloc: a process that loads a model keeps freed blocks in its heap for the next forward."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = """
import sys, torch
from kvwire.malloc import keep_freed_memory
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
applied = keep_freed_memory()
before = rss_mb()
x = torch.ones(16 << 20)  # 64 MiB, touched
del x
print(applied, round(rss_mb() - before))
"""


def _run(env: dict[str, str]) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True,
                         env={k: v for k, v in {**os.environ, **env}.items() if v is not None}).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc")
def test_freed_blocks_stay_in_the_heap_unless_switched_off():
    applied, kept = _run({"KVWIRE_MALLOC": "auto", "MALLOC_MMAP_THRESHOLD_": None, "MALLOC_TRIM_THRESHOLD_": None})
    assert applied == "True" and kept >= 48, kept  # the 64 MiB block is still resident, for reuse
    applied, kept = _run({"KVWIRE_MALLOC": "0"})
    assert applied == "False" and kept < 16, kept  # glibc's default: mmap'd, handed back at free
    applied, _ = _run({"KVWIRE_MALLOC": "auto", "MALLOC_TRIM_THRESHOLD_": "131072"})
    assert applied == "False"  # the user's own glibc settings win


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc")
def test_loading_a_model_applies_it():
    probe = _PROBE.replace("applied = keep_freed_memory()",
                           "from kvwire.config import DEFAULT_MODEL_DIR; from kvwire.runtime import EngineConfig, load_engine; "
                           "load_engine(EngineConfig(DEFAULT_MODEL_DIR, num_pages=8)); applied = True")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}).stdout.split()
    assert int(out[1]) >= 48, out
