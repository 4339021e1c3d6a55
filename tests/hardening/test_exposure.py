"""/metrics binds --listen's host unless --metrics-host says otherwise (a real tokenizer_svc process)."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvwire.config import DEFAULT_MODEL_DIR
from kvwire_serving.security import metrics_host
from tests.hardening.procs import Service
from tools.stack import free_port


def listening_hosts(port: int) -> set[str]:
    """IPv4 addresses a TCP socket listens on at ``port`` (from /proc/net/tcp; state 0A = LISTEN)."""
    hosts = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if int(p, 16) == port and state == "0A":
            hosts.add(".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return hosts


@pytest.mark.parametrize("extra, expected", [([], "127.0.0.1"), (["--metrics-host", "0.0.0.0"], "0.0.0.0")])
def test_metrics_bind_follows_listen_unless_set(tmp_path, extra, expected):
    port = free_port()
    svc = Service("tokenizer_svc", ["--model-dir", str(DEFAULT_MODEL_DIR), "--decode-addr", f"127.0.0.1:{free_port()}",
                                    "--metrics-port", str(port), *extra], tmp_path / "svc.log").start().wait_serving()
    try:
        assert listening_hosts(port) == {expected}
    finally:
        assert svc.stop() == 0


def test_metrics_host_rule():
    def host(listen, explicit=None):
        return metrics_host(argparse.Namespace(listen=listen, metrics_host=explicit))
    assert host("127.0.0.1:50051") == "127.0.0.1"
    assert host("0.0.0.0:50051") == "0.0.0.0"
    assert host("[::1]:50051") == "::1"
    assert host("127.0.0.1:50051", "10.0.0.5") == "10.0.0.5"
