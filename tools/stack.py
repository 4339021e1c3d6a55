"""Start the three services as real processes on loopback, wait for their health, stop them.

Used by the quick start (``python -m tools.run_local``) and by the integration tests. Each service
is ``python -m <service>`` with flags; readiness is the stock ``grpc.health.v1`` client seeing
SERVING; shutdown is SIGTERM (graceful drain), then SIGKILL after a deadline.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvwire.config import DEFAULT_MODEL_DIR
from kvwire.threads import usable_cpus

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(addr: str, timeout_s: float, proc: subprocess.Popen | None = None, service: str = "") -> None:
    """Poll the standard health service until it answers SERVING for ``service`` ("" = the server as
    a whole; a service name = ready, e.g. decode once its prefill replica answers) (raise on timeout or exit)."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the service at {addr} exited with code {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{addr} not SERVING after {timeout_s:.0f} s")
            time.sleep(0.2)


def proc_memory_mb(pid: int) -> dict[str, float]:
    """A process's resident memory from /proc/<pid>/status, in MiB: "VmRSS" (now) and "VmHWM" (its
    peak since it started); {} where /proc has neither (not Linux, or the process is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {key: int(value.split()[0]) / 1024 for key, _, value in (line.partition(":") for line in lines)
            if key in ("VmRSS", "VmHWM")}


def split_cpus(cpus: int) -> dict[str, int]:
    """Compute threads for prefill_svc and decode_svc sharing ``cpus`` cores: half each (decode
    gets the odd one). Both at the full count would run twice as many OpenMP threads as cores, and
    while both compute, every barrier waits for a thread the other process holds off its core
    (measured on 2 cores, SmolLM2 int8: a decode loop and a prefill loop running at once kept 17%
    and 16% of their speed alone with 2 threads each, 80% and 66% with 1 each). This is each
    one's share while both compute; with ``--share-cores`` (``Stack.share_cores``) one that computes
    alone uses every core."""
    prefill = max(1, cpus // 2)
    return {"prefill_svc": prefill, "decode_svc": max(1, cpus - prefill)}


SERVICE_NAMES = {"prefill_svc": "kvwire.v1.PrefillService", "decode_svc": "kvwire.v1.DecodeService",
                 "tokenizer_svc": "kvwire.v1.TokenizerService"}


@dataclass
class Stack:
    model_dir: Path = DEFAULT_MODEL_DIR
    weights: str = "none"
    kv_dtype: str = "fp8_e4m3"
    decode_pages: int = 2048
    prefill_pages: int = 1024
    extra: dict[str, list[str]] = field(default_factory=dict)  # per-service extra flags
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    share_cores: bool = True  # when the cores are split: prefill and decode lend each other theirs
    services: tuple[str, ...] = ("prefill_svc", "decode_svc", "tokenizer_svc")  # started in this order
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    cores_file: Path | None = field(default=None, repr=False)  # --share-cores, while started

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def _flags(self, name: str) -> list[str]:
        flags = ["--listen", self.addr(name)]
        flags += ["--model-dir", str(self.model_dir)]
        if name != "tokenizer_svc":
            pages = self.decode_pages if name == "decode_svc" else self.prefill_pages
            flags += ["--weights", self.weights, "--kv-dtype", self.kv_dtype, "--num-pages", str(pages)]
        if name == "decode_svc":
            flags += ["--prefill-addr", self.addr("prefill_svc")]
        # --threads: split_cpus(this process's usable CPUs), unless given in extra or OMP_NUM_THREADS is set
        threads = {} if "OMP_NUM_THREADS" in {**os.environ, **self.env} else split_cpus(usable_cpus())
        if name in threads and "--threads" not in self.extra.get(name, []):
            flags += ["--threads", str(threads[name])]
        if name in threads and self.cores_file is not None and "--share-cores" not in self.extra.get(name, []):
            flags += ["--share-cores", str(self.cores_file)]
        if name == "tokenizer_svc":
            flags += ["--decode-addr", self.addr("decode_svc")]
        return flags + self.extra.get(name, [])

    def start(self, timeout_s: float = 120.0) -> "Stack":
        names = self.services
        if self.share_cores and self.cores_file is None:
            fd, path = tempfile.mkstemp(prefix="kvwire-cores-")
            os.close(fd)
            self.cores_file = Path(path)
        for name in SERVICE_NAMES:  # every port, so a started service's flags can name the others
            self.ports.setdefault(name, free_port())
        env = {**os.environ, "PYTHONPATH": str(REPO), **self.env}
        for name in names:
            out = open(self.log_dir / f"{name}.log", "wb") if self.log_dir else subprocess.DEVNULL
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", name, *self._flags(name)], cwd=REPO, env=env,
                stdout=out, stderr=subprocess.STDOUT)
        try:
            for name in names:  # ready, not only alive: decode's readiness follows prefill's
                wait_serving(self.addr(name), timeout_s, self.procs[name], service=SERVICE_NAMES[name])
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 15.0) -> dict[str, int | None]:
        """SIGTERM every service (front door first), wait, SIGKILL stragglers; returns exit codes."""
        for name in ("tokenizer_svc", "decode_svc", "prefill_svc"):
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = {}
        for name, p in self.procs.items():
            try:
                codes[name] = p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[name] = p.wait()
        if self.cores_file is not None:
            self.cores_file.unlink(missing_ok=True)
            self.cores_file = None
        return codes

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
