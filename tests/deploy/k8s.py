"""Rendering the kustomize overlays offline and reading the rendered objects (for tests/deploy)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "cpu-observability")
# The three services: Deployment name -> (python module, OTel service.name, proto service)
SERVICES = {
    "tokenizer": ("tokenizer_svc", "kvwire-tokenizer", "kvwire.v1.TokenizerService"),
    "decode": ("decode_svc", "kvwire-decode", "kvwire.v1.DecodeService"),
    "prefill": ("prefill_svc", "kvwire-prefill", "kvwire.v1.PrefillService"),
}
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed: cannot render the kustomize overlays offline "
                    "(install kubectl >= 1.27, which bundles kustomize v5)")
    return path


@lru_cache(maxsize=None)
def _render(path: str) -> tuple[dict, ...]:
    out = subprocess.run([kubectl(), "kustomize", path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def render(overlay: str) -> list[dict]:
    """Every object ``kubectl kustomize deploy/k8s/overlays/<overlay>`` renders (or ``base``)."""
    path = K8S / "base" if overlay == "base" else K8S / "overlays" / overlay
    return list(_render(str(path)))


@lru_cache(maxsize=None)
def help_text(module: str) -> str:
    """``python -m <module> --help`` from the repository root (asserting that it starts)."""
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "usage" in out.stdout.lower(), \
        f"python -m {module} --help failed:\n{out.stderr[-2000:]}"
    return out.stdout


def of_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels only, as kvwire uses) against a pod's labels."""
    assert not selector.get("matchExpressions"), "kvwire's selectors use matchLabels only"
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


@dataclass(frozen=True)
class Container:
    """A container with its $(VAR) references expanded the way the kubelet expands them."""
    deployment: str
    namespace: str
    spec: dict
    env: dict[str, str]
    argv: tuple[str, ...]  # command + args, expanded

    def flag(self, name: str) -> str | None:
        """The value of ``--name=value`` or ``--name value`` in argv (None if absent)."""
        for i, a in enumerate(self.argv):
            if a == name and i + 1 < len(self.argv):
                return self.argv[i + 1]
            if a.startswith(name + "="):
                return a.split("=", 1)[1]
        return None

    def flags(self) -> list[str]:
        return [a.split("=", 1)[0] for a in self.argv if a.startswith("--")]

    def port(self, name: str) -> int | None:
        return next((p["containerPort"] for p in self.spec.get("ports", []) if p.get("name") == name), None)


def containers(objs: list[dict], deployment: dict, init: bool = False) -> list[Container]:
    ns = deployment["metadata"]["namespace"]
    config_maps = {c["metadata"]["name"]: c.get("data", {}) for c in of_kind(objs, "ConfigMap")}
    pod = deployment["spec"]["template"]["spec"]
    out = []
    for c in pod.get("initContainers" if init else "containers", []):
        env: dict[str, str] = {}
        for src in c.get("envFrom", []):
            name = src["configMapRef"]["name"]
            assert name in config_maps, f"{c['name']} reads ConfigMap {name}, which is not rendered"
            env.update(config_maps[name])
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), e["value"])
            else:
                field = e["valueFrom"]["fieldRef"]["fieldPath"]
                env[e["name"]] = {"metadata.namespace": ns, "metadata.name": "pod-0"}[field]

        def expand(s: str) -> str:
            missing = [v for v in _VAR.findall(s) if v not in env]
            assert not missing, f"{deployment['metadata']['name']}/{c['name']}: $({missing[0]}) is not defined"
            return _VAR.sub(lambda m: env[m.group(1)], s)
        argv = tuple(expand(a) for a in [*c.get("command", []), *c.get("args", [])])
        out.append(Container(deployment["metadata"]["name"], ns, c, env, argv))
    return out
