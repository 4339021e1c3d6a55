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
import threading
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


def service_of(name: str) -> str:
    """A process name's service: "decode_svc.1" (decode's second replica) -> "decode_svc"."""
    return name.partition(".")[0]


def metrics_text(port: int, timeout_s: float = 5.0) -> str:
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as r:
        return r.read().decode()


def metric_value(text: str, name: str, labels: str = "") -> float:
    """The sum of the samples of ``name`` whose label set contains ``labels`` (e.g. 'grpc_method="/x"')."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in "{ ") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Stack:
    """The three services on loopback; ``prefill_replicas`` / ``decode_replicas`` > 1 start that many
    processes of a service (names "decode_svc", "decode_svc.1", ...), and its peers reach them through
    one ``ipv4:127.0.0.1:p1,127.0.0.1:p2`` target: gRPC round_robin over the addresses, as
    ``dns:///`` gives on Kubernetes. ``prefill_replicas=0``: no prefill_svc, decode_svc prefills
    every prompt itself on every core (the small-host shape). ``metrics``: each process serves
    /metrics on its own port."""
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
    prefill_replicas: int = 1
    decode_replicas: int = 1
    metrics: bool = False
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)
    cores_file: Path | None = field(default=None, repr=False)  # --share-cores, while started
    _sigterm: object = field(default=None, init=False, repr=False)  # the SIGTERM handler start() replaced, while started

    def replicas(self, service: str) -> list[str]:
        """The process names of ``service``'s replicas, the first one named as the service."""
        n = {"prefill_svc": self.prefill_replicas, "decode_svc": self.decode_replicas}.get(service, 1)
        return [service] + [f"{service}.{i}" for i in range(1, n)] if n else []

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def target(self, service: str) -> str:
        """How a peer reaches every replica of ``service``: one address, or an ``ipv4:`` list."""
        names = self.replicas(service)
        if not names:
            return ""
        if len(names) == 1:
            return self.addr(names[0])
        return "ipv4:" + ",".join(self.addr(n) for n in names)

    def _flags(self, name: str) -> list[str]:
        service = service_of(name)
        flags = ["--listen", self.addr(name)]
        flags += ["--model-dir", str(self.model_dir)]
        if service != "tokenizer_svc":
            pages = self.decode_pages if service == "decode_svc" else self.prefill_pages
            flags += ["--weights", self.weights, "--kv-dtype", self.kv_dtype, "--num-pages", str(pages)]
        prefill = bool(self.replicas("prefill_svc"))
        if service == "decode_svc" and prefill:
            flags += ["--prefill-addr", self.target("prefill_svc")]
        extra = self.extra.get(service, [])
        # --threads: split_cpus(this process's usable CPUs) (every one for decode without prefill_svc),
        # unless given in extra or OMP_NUM_THREADS is set
        threads = {} if "OMP_NUM_THREADS" in {**os.environ, **self.env} else \
            split_cpus(usable_cpus()) if prefill else {"decode_svc": usable_cpus()}
        if service in threads and "--threads" not in extra:
            flags += ["--threads", str(threads[service])]
        if service in threads and prefill and self.cores_file is not None and "--share-cores" not in extra:
            flags += ["--share-cores", str(self.cores_file)]
        if service == "tokenizer_svc":
            flags += ["--decode-addr", self.target("decode_svc")]
        if name in self.metrics_ports:
            flags += ["--metrics-port", str(self.metrics_ports[name])]
        return flags + extra

    def _spawn(self, name: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), **self.env}
        out = open(self.log_dir / f"{name}.log", "ab") if self.log_dir else subprocess.DEVNULL
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", service_of(name), *self._flags(name)], cwd=REPO, env=env,
            stdout=out, stderr=subprocess.STDOUT)

    def _stop_on_sigterm(self) -> None:
        """SIGTERM to this process (``kill``, ``docker stop``, a process manager) raises SystemExit in the
        main thread, so the ``with`` block unwinds and ``stop()`` drains the services; by default it
        would end this process at once and leave them running with their ports and memory. Only
        where the handler is still the default one (a program's own handler wins)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return

        def exit_143(signum, _frame):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the drain short
            raise SystemExit(128 + signum)
        self._sigterm = signal.signal(signal.SIGTERM, exit_143)

    def start(self, timeout_s: float = 120.0) -> "Stack":
        names = [n for service in self.services for n in self.replicas(service)]
        self._stop_on_sigterm()
        if self.share_cores and self.cores_file is None:
            fd, path = tempfile.mkstemp(prefix="kvwire-cores-")
            os.close(fd)
            self.cores_file = Path(path)
        for service in SERVICE_NAMES:  # every port, so a started service's flags can name the others
            for name in self.replicas(service):
                self.ports.setdefault(name, free_port())
                if self.metrics:
                    self.metrics_ports.setdefault(name, free_port())
        for name in names:
            self._spawn(name)
        try:
            for name in names:  # ready, not only alive: decode waits for a loading prefill (decode_svc/readiness.py)
                wait_serving(self.addr(name), timeout_s, self.procs[name], service=SERVICE_NAMES[service_of(name)])
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, name: str) -> None:
        """SIGKILL one process (no drain: a crash or a lost node) and reap it."""
        self.procs[name].kill()
        self.procs[name].wait()

    def restart(self, name: str, timeout_s: float = 120.0) -> None:
        """Start a killed or stopped process again on its port, with its flags; wait until ready."""
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running")
        self._spawn(name)
        wait_serving(self.addr(name), timeout_s, self.procs[name], service=SERVICE_NAMES[service_of(name)])

    def stop(self, timeout_s: float = 15.0) -> dict[str, int | None]:
        """SIGTERM every service (front door first), wait, SIGKILL stragglers; returns exit codes."""
        for service in ("tokenizer_svc", "decode_svc", "prefill_svc"):
            for name in self.replicas(service):
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
        if self._sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None
        return codes

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
