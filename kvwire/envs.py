"""Every environment variable the project reads, declared once: name, type, default, one line of doc.

Python code reads them only here (``envs.get("KVWIRE_AMX")``, or ``envs.KVWIRE_AMX``), at call
time, so a test's ``monkeypatch.setenv`` is seen; tests/kvwire/test_envs.py fails on any other
``os.environ``/``os.getenv`` read of a ``KVWIRE_`` name. ``kind`` says who reads a variable:

- ``python``: the library, the kernels or the services (``flag``: the service flag it defaults);
- ``shell``: a shell script (tools/demo.sh);
- ``deploy``: the Kubernetes manifests substitute it into a flag (deploy/k8s, ConfigMap ``kvwire``);
- ``bench``: benchmarks and their tests only;
- ``external``: not ours (OpenMP, glibc, the C compiler), read by the project too.

Torch-free and dependency-free: kvwire_kernels and the tokenizer service import it.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OFF = ("0", "off", "false", "no")  # what switches an "auto" variable off
ON = ("1", "true", "yes")  # what turns a boolean flag's variable on


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: type  # str, int, float, bool or Path: what ``get`` returns when the variable is set
    default: Any  # what ``get`` returns when it is not
    doc: str
    kind: str = "python"  # python | shell | deploy | bench | external
    flag: str | None = None  # the service flag whose default it is


def _v(name: str, type_: type, default: Any, doc: str, kind: str = "python", flag: str | None = None) -> EnvVar:
    return EnvVar(name, type_, default, doc, kind, flag)


def _peer_vars(peer: str) -> list[EnvVar]:
    p = f"KVWIRE_{peer.upper()}"
    return [_v(f"{p}_TLS_CA", Path, None, f"CA that signed {peer}'s certificate", flag=f"--{peer}-tls-ca"),
            _v(f"{p}_TLS_CERT", Path, None, f"client certificate presented to {peer}", flag=f"--{peer}-tls-cert"),
            _v(f"{p}_TLS_KEY", Path, None, "its private key", flag=f"--{peer}-tls-key"),
            _v(f"{p}_TLS_SERVER_NAME", str, None, f"name expected in {peer}'s certificate",
               flag=f"--{peer}-tls-server-name"),
            _v(f"{p}_TOKEN_FILE", Path, None, f"bearer token sent to {peer}", flag=f"--{peer}-token-file")]


_VARS = [
    # the library and the kernels
    _v("KVWIRE_MALLOC", str, "auto", "0: leave glibc's malloc settings alone (engines: kvwire/malloc.py; front door: tokenizer_svc/memory.py)"),
    _v("KVWIRE_CPU_KERNELS", str, "auto", "CPU C kernels: auto (when they build or are prebuilt), 0 (off), "
       "1 (required)"),
    _v("KVWIRE_KERNEL_CACHE", Path, Path.home() / ".cache" / "kvwire" / "kernels",
       "where the CPU kernels are compiled to"),
    _v("KVWIRE_AWQ_CACHE", Path, Path.home() / ".cache" / "kvwire" / "awq",
       "where --weights int4-awq keeps the scales it searched (one small file per model and calibration) "
       "and int4-gptq its 4-bit blocks (the size of the 4-bit model)"),
    _v("KVWIRE_KERNEL_PREBUILT", Path, None, "directory of prebuilt CPU kernels (default: kvwire_kernels/cpu/prebuilt)"),
    _v("KVWIRE_AMX", str, "auto", "0: no AMX tiles in the int8 CPU kernels"),
    _v("KVWIRE_INT8_ACTIVATIONS", str, "auto", "0: int8 weights multiply fp32/bf16 activations (no VNNI path)"),
    _v("KVWIRE_BF16_ACTIVATIONS", str, "auto", "0: bf16 weights multiply fp32 activations (no AVX512-BF16 path)"),
    _v("KVWIRE_PREFILL_LAYERS", str, "auto", "0: prompt chunks take the PyTorch forward, not the one C call "
       "(kvwire/model/fast_decode.py)"),
    # service flags' defaults (kvwire/args/)
    _v("KVWIRE_TLS_CERT", Path, None, "server certificate chain (PEM)", flag="--tls-cert"),
    _v("KVWIRE_TLS_KEY", Path, None, "server private key (PEM)", flag="--tls-key"),
    _v("KVWIRE_TLS_CLIENT_CA", Path, None, "CA client certificates must be signed by (mTLS)", flag="--tls-client-ca"),
    _v("KVWIRE_ALLOWED_PEERS", str, None, "client certificate names allowed to call", flag="--allowed-peers"),
    _v("KVWIRE_AUTH_TOKENS_FILE", Path, None, "bearer tokens accepted", flag="--auth-tokens-file"),
    _v("KVWIRE_HEALTH_LISTEN", str, None, "plaintext health-only listener", flag="--health-listen"),
    _v("KVWIRE_METRICS_HOST", str, None, "interface /metrics binds", flag="--metrics-host"),
    _v("KVWIRE_DRAIN_DELAY_S", float, 5.0, "seconds NOT_SERVING before the drain at SIGTERM (also in deploy/k8s)",
       flag="--drain-delay-s"),
    _v("KVWIRE_NO_REFLECTION", bool, False, "1: no gRPC reflection", flag="--no-reflection"),
    *_peer_vars("decode"), *_peer_vars("prefill"),
    # read by shell scripts
    _v("KVWIRE_DEMO_MODEL", str, None, "tools/demo.sh: 'embedded' skips fetching SmolLM2", "shell"),
    # substituted into flags by the Kubernetes manifests
    _v("KVWIRE_MODEL", str, "smollm2-135m-instruct", "model fetched by the init container; --model-name", "deploy"),
    _v("KVWIRE_MODEL_DIR", Path, "/models/smollm2-135m-instruct", "--model-dir", "deploy"),
    _v("KVWIRE_WEIGHTS", str, "int8", "--weights", "deploy"),
    _v("KVWIRE_KV_DTYPE", str, "fp8_e4m3", "--kv-dtype", "deploy"),
    _v("KVWIRE_DEVICE", str, "cpu", "--device", "deploy"),
    _v("KVWIRE_BLOCK_SIZE", int, 16, "--block-size", "deploy"),
    _v("KVWIRE_PREFILL_PAGES", int, 1024, "prefill_svc --num-pages", "deploy"),
    _v("KVWIRE_DECODE_PAGES", int, 2048, "decode_svc --num-pages", "deploy"),
    _v("KVWIRE_MAX_RUNNING", int, 16, "--max-running", "deploy"),
    _v("KVWIRE_MAX_WAITING", int, 64, "--max-waiting", "deploy"),
    _v("KVWIRE_SPECULATIVE", str, "none", "--speculative", "deploy"),
    _v("KVWIRE_GRACE_S", float, 20.0, "--grace-s", "deploy"),
    # benchmarks
    _v("KVWIRE_VLLM_VENV", Path, None, "virtual environment with vLLM for the peer benchmark (tests/bench)", "bench"),
    # not ours, read by the project too
    _v("OMP_NUM_THREADS", int, None, "OpenMP threads: --threads' default when set", "external"),
    _v("CC", str, None, "C compiler for the CPU kernels (default: gcc, else cc)", "external"),
    _v("MALLOC_MMAP_THRESHOLD_", int, None, "glibc's own setting: when set, kvwire/malloc.py leaves malloc alone",
       "external"),
    _v("MALLOC_TRIM_THRESHOLD_", int, None, "as MALLOC_MMAP_THRESHOLD_", "external"),
    _v("MALLOC_ARENA_MAX", int, None, "glibc's own setting: when set, tokenizer_svc/memory.py leaves malloc alone",
       "external"),
]
REGISTRY: dict[str, EnvVar] = {v.name: v for v in _VARS}


def _var(name: str) -> EnvVar:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in kvwire/envs.py") from None


def raw(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The variable's text, None when unset (``env``: another mapping than ``os.environ``)."""
    _var(name)
    return (os.environ if env is None else env).get(name)


def is_set(name: str, env: Mapping[str, str] | None = None) -> bool:
    return raw(name, env) is not None


def get(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The variable parsed to its declared type, or its default when unset."""
    var, text = _var(name), raw(name, env)
    if text is None:
        return var.default
    if var.type is bool:
        return text.strip().lower() in ON
    return var.type(text)


def switched_off(name: str, env: Mapping[str, str] | None = None) -> bool:
    """An ``auto`` switch set to 0 / off / false / no."""
    return str(get(name, env)).lower() in OFF


def __getattr__(name: str) -> Any:  # envs.KVWIRE_AMX: read now, not at import
    if name in REGISTRY:
        return get(name)
    raise AttributeError(f"module 'kvwire.envs' has no attribute {name!r}")


def markdown() -> str:
    """The registry as a Markdown table (docs/configuration.md)."""
    rows = ["| variable | kind | default | meaning |", "|---|---|---|---|"]
    for v in _VARS:
        default = "" if v.default is None else str(v.default)
        if isinstance(v.default, Path) and str(v.default).startswith(str(Path.home())):
            default = "~/" + str(v.default.relative_to(Path.home()))
        doc = f"{v.doc} (default of `{v.flag}`)" if v.flag else v.doc
        rows.append(f"| `{v.name}` | {v.kind} | {f'`{default}`' if default else ''} | {doc} |")
    return "\n".join(rows) + "\n"
