"""SIGTERM: health NOT_SERVING for --drain-delay-s while calls are still served, then the drain,
then exit 0 — for each service, as a real process."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvwire.config import DEFAULT_MODEL_DIR
from tests.hardening.procs import Service
from tools.stack import REPO, free_port

DELAY_S = 3.0


def _takes_security_flags(module: str) -> bool:
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True)
    return "--drain-delay-s" in out.stdout and "--health-listen" in out.stdout


SERVICES = {
    "tokenizer_svc": ["--model-dir", str(DEFAULT_MODEL_DIR), "--decode-addr", f"127.0.0.1:{free_port()}"],
    "prefill_svc": ["--model-dir", str(DEFAULT_MODEL_DIR), "--num-pages", "64"],
    "decode_svc": ["--model-dir", str(DEFAULT_MODEL_DIR), "--num-pages", "64", "--prefill-addr", ""],
}


@pytest.mark.parametrize("module", list(SERVICES))
def test_sigterm_reports_not_serving_for_the_drain_delay_then_exits_0(module, tmp_path):
    if not _takes_security_flags(module):
        pytest.skip(f"{module} does not take --drain-delay-s yet")
    svc = Service(module, [*SERVICES[module], "--drain-delay-s", str(DELAY_S)], tmp_path / "svc.log",
                  env={"KVWIRE_DRAIN_DELAY_S": str(DELAY_S)}).start()
    svc.wait_serving()
    try:
        with grpc.insecure_channel(svc.addr) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
            t0 = time.monotonic()
            svc.proc.send_signal(signal.SIGTERM)
            statuses = []
            while time.monotonic() - t0 < DELAY_S - 1.0:  # the listener still answers during the delay
                statuses.append(health.Check(health_pb2.HealthCheckRequest(), timeout=2).status)
                time.sleep(0.05)
            assert statuses[-1] == health_pb2.HealthCheckResponse.NOT_SERVING
            assert statuses.count(health_pb2.HealthCheckResponse.NOT_SERVING) >= len(statuses) - 2
        assert svc.proc.wait(30) == 0
        assert time.monotonic() - t0 >= DELAY_S  # it waited the delay before closing
    finally:
        svc.stop()
