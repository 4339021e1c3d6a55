"""kvwire.envs: every KVWIRE_* variable the tree mentions is declared there, and Python reads them
only through it."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

from kvwire import envs

REPO = Path(__file__).resolve().parents[2]
# A read of a KVWIRE_ variable straight from the process environment (writes and test setup are fine).
DIRECT_READ = re.compile(r"""os\.getenv\(\s*f?["']KVWIRE_|os\.environ\.get\(\s*f?["']KVWIRE_|"""
                         r"""os\.environ\[\s*f?["']KVWIRE_\w*["']\s*\](?!\s*=[^=])|["']KVWIRE_\w+["']\s+(not\s+)?in\s+os\.environ""")


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split()
    return [REPO / p for p in out if (REPO / p).is_file()]


def test_the_pattern_catches_direct_reads():
    for line in ('os.environ.get("KVWIRE_AMX", "auto")', "os.getenv('KVWIRE_X')", 'os.environ["KVWIRE_X"]',
                 '"KVWIRE_X" in os.environ', 'os.environ.get(f"KVWIRE_{peer}")'):
        assert DIRECT_READ.search(line), line
    for line in ('os.environ["KVWIRE_X"] = "1"', 'monkeypatch.setenv("KVWIRE_X", "0")', 'envs.get("KVWIRE_X")'):
        assert not DIRECT_READ.search(line), line


def test_no_kvwire_variable_is_read_outside_the_registry():
    offenders = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in tracked("*.py") if p not in (REPO / "kvwire/envs.py", Path(__file__).resolve())
                 for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if DIRECT_READ.search(line)]
    assert not offenders, "read KVWIRE_* variables through kvwire.envs:\n" + "\n".join(offenders)


def test_every_variable_the_tree_names_is_declared():
    named: dict[str, str] = {}
    for p in tracked("*.py", "*.sh", "*.yaml", "*.yml", "*Dockerfile*", "*.md", "*.toml"):
        for name in re.findall(r"\bKVWIRE_[A-Z0-9_]*[A-Z0-9]\b", p.read_text(errors="replace")):
            named.setdefault(name, str(p.relative_to(REPO)))
    undeclared = {n: f for n, f in named.items() if n not in envs.REGISTRY and not n.startswith("KVWIRE_X")}
    assert not undeclared, f"declare these in kvwire/envs.py: {undeclared}"
    assert {"KVWIRE_DEMO_MODEL", "KVWIRE_DECODE_PAGES", "KVWIRE_PREFILL_TLS_CA", "KVWIRE_CPU_KERNELS"} <= set(named)


def test_values_are_typed_and_read_when_asked(monkeypatch):
    monkeypatch.delenv("KVWIRE_DRAIN_DELAY_S", raising=False)
    assert envs.get("KVWIRE_DRAIN_DELAY_S") == 5.0
    monkeypatch.setenv("KVWIRE_DRAIN_DELAY_S", "0.5")
    assert envs.get("KVWIRE_DRAIN_DELAY_S") == 0.5 and envs.KVWIRE_DRAIN_DELAY_S == 0.5
    monkeypatch.setenv("KVWIRE_AMX", "off")
    assert envs.switched_off("KVWIRE_AMX")
    monkeypatch.setenv("KVWIRE_AMX", "auto")
    assert not envs.switched_off("KVWIRE_AMX")
    assert envs.get("KVWIRE_NO_REFLECTION", env={"KVWIRE_NO_REFLECTION": "true"}) is True
    assert envs.get("KVWIRE_KERNEL_CACHE", env={"KVWIRE_KERNEL_CACHE": "/k"}) == Path("/k")


def test_an_undeclared_name_is_an_error():
    import pytest

    with pytest.raises(KeyError, match="not declared"):
        envs.get("KVWIRE_" + "NOPE")


def test_each_variable_says_who_reads_it():
    kinds = {v.kind for v in envs.REGISTRY.values()}
    assert kinds == {"python", "shell", "deploy", "bench", "external"}
    assert envs.REGISTRY["KVWIRE_DEMO_MODEL"].kind == "shell"
    assert envs.REGISTRY["KVWIRE_TLS_CERT"].flag == "--tls-cert"
    table = envs.markdown()
    assert all(f"`{name}`" in table for name in envs.REGISTRY)
