"""Compute threads: what ``--threads`` defaults to, and how the local stack splits a host's cores."""
from __future__ import annotations

import argparse

import pytest
import torch

from kvwire.args import make_parser
from kvwire_serving import cli
from tools.stack import Stack, split_cpus


@pytest.mark.parametrize("cpus, prefill, decode", [(1, 1, 1), (2, 1, 1), (3, 1, 2), (8, 4, 4), (17, 8, 9)])
def test_split_gives_each_service_half_the_cores_and_never_zero(cpus, prefill, decode):
    assert split_cpus(cpus) == {"prefill_svc": prefill, "decode_svc": decode}


def test_usable_cpus_follows_the_affinity_mask():
    assert 1 <= cli.usable_cpus() <= len(__import__("os").sched_getaffinity(0))


def parse(argv: list[str]) -> argparse.Namespace:
    return make_parser("prefill_svc").parse_args(argv)  # unchecked: set_threads checks --threads itself


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_flag_sets_torch_threads(restore_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # an explicit flag wins over the environment
    assert cli.set_threads(parse(["--threads", "1"])) == 1 == torch.get_num_threads()


def test_default_is_usable_cpus_unless_omp_num_threads_is_set(restore_threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cli, "usable_cpus", lambda: 1)
    assert cli.set_threads(parse([])) == 1
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cli.set_threads(parse([])) == 2  # left to torch, which read OMP_NUM_THREADS


def test_threads_below_one_is_refused():
    with pytest.raises(SystemExit, match="--threads must be at least 1"):
        cli.set_threads(parse(["--threads", "0"]))


def test_stack_passes_the_split_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("tools.stack.usable_cpus", lambda: 4)
    s = Stack(ports={"prefill_svc": 1, "decode_svc": 2, "tokenizer_svc": 3})
    flags = {name: s._flags(name) for name in ("prefill_svc", "decode_svc", "tokenizer_svc")}
    assert flags["prefill_svc"][flags["prefill_svc"].index("--threads") + 1] == "2"
    assert flags["decode_svc"][flags["decode_svc"].index("--threads") + 1] == "2"
    assert "--threads" not in flags["tokenizer_svc"]
    explicit = Stack(ports=s.ports, extra={"decode_svc": ["--threads", "3"]})
    assert explicit._flags("decode_svc").count("--threads") == 1
    assert "--threads" not in Stack(ports=s.ports, env={"OMP_NUM_THREADS": "1"})._flags("prefill_svc")
