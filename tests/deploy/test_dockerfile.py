"""deploy/Dockerfile, checked without building it (no container runtime is assumed): every path it
copies exists, every command it names is a module that starts, and they are the README's commands."""
from __future__ import annotations

import re
import shlex

import pytest

from tests.deploy.k8s import OVERLAYS, REPO, containers, help_text, of_kind, render

DOCKERFILE = REPO / "deploy" / "Dockerfile"


def stages() -> list[list[str]]:
    """Instructions (continuation lines joined, comments dropped) grouped by FROM."""
    out: list[list[str]] = []
    text = re.sub(r"\\\n\s*", " ", "\n".join(l for l in DOCKERFILE.read_text().splitlines()
                                            if not l.lstrip().startswith("#")))
    for line in filter(None, (l.strip() for l in text.splitlines())):
        if line.upper().startswith("FROM "):
            out.append([])
        if out:
            out[-1].append(line)
    return out


def named_modules() -> set[str]:
    """The image's entrypoints: every ``python -m X`` in the Dockerfile's usage comments and its CMD."""
    text = DOCKERFILE.read_text()
    usage = "\n".join(l for l in text.splitlines() if l.startswith("#"))
    cmd = " ".join(l for s in stages() for l in s if l.startswith("CMD ")).replace('", "', " ")
    return set(re.findall(r"python -m ([a-z_.]+)", usage + "\n" + cmd))


def build_modules() -> set[str]:
    """``python -m X`` run while building (RUN lines)."""
    return {m for s in stages() for l in s if l.startswith("RUN ") for m in re.findall(r"python -m ([a-z_.]+)", l)}


def test_multi_stage_non_root_and_no_model_or_build_tools_in_the_final_stage():
    """The CPU image (``--target runtime``) has no compiler; the CUDA one adds only what Triton needs."""
    build, runtime, _cuda = stages()
    assert build[0].endswith(" AS build") and runtime[0].endswith(" AS runtime")
    user = [l for l in runtime if l.startswith("USER ")]
    assert user and user[-1].split()[1].split(":")[0] not in ("0", "root")
    final = "\n".join(runtime)
    for tool in ("gcc", "g++", "build-essential", "make ", "apt-get install", "pip install"):
        assert tool not in final, f"the runtime stage installs {tool.strip()}"
    copies = [l for l in runtime if l.startswith("COPY ")]
    assert all("--from=build" in l for l in copies), "the runtime stage copies only from the build stage"
    assert not any("models" in l.split()[1:-1] for l in build if l.startswith("COPY ")), "the model is not baked in"
    torch = [l for l in build if "torch==" in l]
    assert torch and "${TORCH_VERSION}" in torch[0]
    assert "ARG TORCH_VERSION=2.13.0" in build  # the version tools/setup.sh installs
    assert 'torch==2.13.0' in (REPO / "tools" / "setup.sh").read_text()


def test_cuda_image_carries_a_c_compiler_for_triton_and_stays_non_root():
    """Triton builds its kernels' C launchers with the host's C compiler at first launch."""
    _, _, cuda = stages()
    assert cuda[0] == "FROM runtime AS runtime-cuda"
    installs = [l for l in cuda if l.startswith("RUN ") and "apt-get install" in l]
    assert installs and re.search(r"\bgcc\b", installs[0]) and "libc6-dev" in installs[0]
    assert "rm -rf /var/lib/apt/lists/*" in installs[0]
    assert not any("COPY " in l or "pip install" in l for l in cuda)  # nothing else comes in
    user = [l for l in cuda if l.startswith("USER ")]
    assert user[-1] == "USER 10001:10001"
    assert any(l.startswith("ENV TRITON_CACHE_DIR=/tmp/") for l in cuda)  # / is read-only in Kubernetes
    usage = DOCKERFILE.read_text()
    assert "--target runtime-cuda -t kvwire:0.1.0-cuda" in usage and "--target runtime -t kvwire:0.1.0-cpu" in usage


def test_every_copied_path_exists():
    build, *_ = stages()
    for line in build:
        if line.startswith("COPY ") and "--from=" not in line:
            *sources, _dest = shlex.split(line)[1:]
            for src in sources:
                assert (REPO / src).exists(), f"{line}: {src} is not in the repository"


def test_named_commands_start_and_are_the_readme_and_manifest_commands():
    modules = named_modules()
    assert {"tokenizer_svc", "decode_svc", "prefill_svc", "tools.fetch_model"} <= modules
    for module in build_modules() - {"venv"}:  # build steps (stub generation) run from the copied sources
        path = REPO / module.replace(".", "/")
        assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), module
    readme = (REPO / "README.md").read_text()
    for service in ("tokenizer_svc", "decode_svc", "prefill_svc"):
        assert re.search(rf"python -m {service}\s+--listen", readme), f"the README does not run {service}"
    for module in sorted(modules):
        help_text(module)  # starts, prints its usage


def test_manifest_commands_are_commands_the_image_names():
    modules = named_modules()
    used = set()
    for overlay in OVERLAYS:
        objs = render(overlay)
        assert all(o["metadata"].get("namespace") == "kvwire" for o in objs if o["kind"] != "Namespace")
        for dep in of_kind(objs, "Deployment"):
            for c in containers(objs, dep) + containers(objs, dep, init=True):
                if c.argv[:2] == ("python", "-m"):
                    used.add(c.argv[2])
    if not used:
        pytest.fail("no python -m commands in the manifests")
    assert used <= modules, f"the manifests run {used - modules}, which the Dockerfile does not name"
