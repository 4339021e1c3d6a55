"""Services as real processes for the hardening tests, each with a plaintext health-only port
(``--health-listen``) so readiness can be polled whatever TLS the main port demands."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tools.stack import REPO, free_port, proc_memory_mb, wait_serving


@dataclass
class Service:
    module: str
    args: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    health_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "Service":
        env = {**os.environ, "PYTHONPATH": str(REPO), "KVWIRE_DRAIN_DELAY_S": "0", **self.env}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, "--listen", self.addr,
             "--health-listen", f"127.0.0.1:{self.health_port}", *self.args],
            cwd=REPO, env=env, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)
        return self

    def wait_serving(self, timeout_s: float = 120.0) -> "Service":
        try:
            wait_serving(f"127.0.0.1:{self.health_port}", timeout_s, self.proc)
        except BaseException:
            self.stop()
            raise
        return self

    def rss_mb(self) -> float:
        return rss_mb(self.proc.pid)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()



@contextmanager
def serving(services: Sequence[Service]) -> Iterator[None]:
    """Start ``services`` in order, wait until each is SERVING; at exit stop them in reverse and
    check that each drained and exited 0."""
    try:
        for s in services:
            s.start()
        for s in services:
            s.wait_serving()
        yield
    finally:
        codes = [s.stop() for s in reversed(services)]
    assert codes == [0] * len(services)

def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (Linux /proc)."""
    rss = proc_memory_mb(pid).get("VmRSS")
    if rss is None:
        raise RuntimeError(f"no VmRSS for pid {pid}")
    return rss
