"""SIGTERM to a program running the services (``python -m tools.run_local --keep-running``, as
``kill`` or ``docker stop`` sends it) drains and stops every service it started: none is left
running with its port and memory after the program exits."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_sigterm_to_run_local_stops_every_service(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "tools.run_local", "--keep-running", "--max-tokens", "4",
                             "--log-dir", str(tmp_path)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    services: list[int] = []
    try:
        for line in proc.stderr:  # bounded: run_local's own start timeout ends the loop if nothing starts
            if "serving; Ctrl-C to stop" in line:
                break
        else:
            raise AssertionError(f"run_local exited with {proc.wait()} before serving")
        services = children(proc.pid)
        assert len(services) == 3 and all(alive(p) for p in services)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while any(alive(p) for p in services) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in services), [p for p in services if alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in services:  # what a failure left behind must not outlive the test
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
