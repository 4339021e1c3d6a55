"""Fixtures the hardening modules share; a module that defines its own ``stack`` uses that one."""
from __future__ import annotations

import grpc
import pytest

from tools.stack import Stack


@pytest.fixture(scope="module")
def stack(request, tmp_path_factory):
    """A real three-service stack per module (the fuzzing modules), logs under the module's name."""
    logs = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2] + "-logs")
    with Stack(decode_pages=256, prefill_pages=256, log_dir=logs) as s:
        yield s


@pytest.fixture(scope="module")
def channels(stack):
    chans = {n: grpc.insecure_channel(stack.addr(n)) for n in ("tokenizer_svc", "decode_svc", "prefill_svc")}
    yield chans
    for ch in chans.values():
        ch.close()
