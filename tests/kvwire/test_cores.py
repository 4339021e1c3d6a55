"""Core lending between co-located services (kvwire_serving.cores, ``--share-cores``): the shared flags,
across real processes, and the threads prefill forwards and decode steps really compute with."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest
import torch

from kvwire import LLM, SamplingParams
from kvwire.config import DEFAULT_MODEL_DIR
from kvwire_serving.cores import CoreShare, use_threads
from kvwire.engine.async_engine import AsyncEngine
from kvwire.engine.kv_source import KVSources, LocalPrefill
from prefill_svc.runner import Aborted, PrefillRunner


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_each_role_gets_every_core_only_while_the_other_is_idle(tmp_path):
    path = tmp_path / "cores"
    prefill, decode = CoreShare(path, "prefill", own=1, total=4), CoreShare(path, "decode", own=3, total=4)
    assert prefill.busy() == 4  # decode idle
    assert decode.busy() == 3  # prefill busy: its own share
    assert prefill.busy() == 1  # and now prefill sees decode
    prefill.idle()
    assert decode.busy() == 4
    decode.idle()
    assert prefill.busy() == 4
    assert path.read_bytes() == b"\x01\x00"


def test_the_flags_cross_processes_and_a_restarted_role_starts_idle(tmp_path):
    path = tmp_path / "cores"
    mine = CoreShare(path, "decode", own=1, total=2)
    code = (f"from kvwire_serving.cores import CoreShare; import sys; c = CoreShare({str(path)!r}, 'prefill', 1, 2); "
            "print(c.busy()); sys.stdout.flush(); sys.stdin.readline()")
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "2"  # decode was idle
        assert mine.busy() == 1  # the other process computes
    finally:
        other.communicate("\n", timeout=30)
    # It exited without idle(): its byte stays set and decode keeps to its share, the static split.
    assert mine.busy() == 1
    CoreShare(path, "prefill", own=1, total=2)  # a restarted prefill clears its own byte
    assert mine.busy() == 2


@pytest.mark.parametrize("role, own, total", [("tokenizer", 1, 2), ("decode", 0, 2), ("decode", 3, 2)])
def test_bad_arguments_are_refused(tmp_path, role, own, total):
    with pytest.raises(ValueError):
        CoreShare(tmp_path / "cores", role, own, total)


def test_use_threads_sets_torch_threads(restore_threads):
    use_threads(1)
    assert torch.get_num_threads() == 1
    use_threads(2)
    assert torch.get_num_threads() == 2


@pytest.fixture(scope="module")
def llm():
    return LLM(DEFAULT_MODEL_DIR, num_pages=64)


def test_prefill_computes_every_layer_on_the_lent_cores_and_gives_them_back(llm, tmp_path, restore_threads):
    cores = CoreShare(tmp_path / "cores", "prefill", own=1, total=2)
    decode = CoreShare(tmp_path / "cores", "decode", own=1, total=2)
    runner = PrefillRunner(llm.runtime, 32, cores=cores)
    seen = []

    def run() -> None:
        seq = runner.new_sequence()
        runner.forward(seq, list(range(1, 20)), lambda layer: seen.append(torch.get_num_threads()), threading.Event())
        runner.release(seq)

    use_threads(1)
    run()
    lent, seen[:] = seen[:], []
    assert (tmp_path / "cores").read_bytes()[0] == 0  # idle again after the forward
    decode.busy()
    run()
    layers = llm.runtime.model_config.num_layers
    assert lent == [2] * layers and seen == [1] * layers


def test_decode_steps_on_the_lent_cores_and_marks_itself_idle_when_done(llm, tmp_path, restore_threads):
    path = tmp_path / "cores"
    prefill = CoreShare(path, "prefill", own=1, total=2)
    steps, execute = [], llm.core.execute
    llm.core.execute = lambda batch: steps.append(torch.get_num_threads()) or execute(batch)

    async def generate() -> list[int]:
        engine = AsyncEngine(llm.core, KVSources(LocalPrefill(llm.core.runner)), cores=CoreShare(path, "decode", own=1, total=2))
        engine.start()
        try:
            out = []
            async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True)):
                out += o.token_ids
            for _ in range(100):  # the loop marks decode idle once it has nothing to step
                if path.read_bytes()[1] == 0:
                    break
                await asyncio.sleep(0.01)
            return out
        finally:
            await engine.close()

    try:
        prefill.busy()
        assert len(asyncio.run(generate())) == 6 and steps and set(steps) == {1}
        steps.clear()
        prefill.idle()
        assert len(asyncio.run(generate())) == 6 and steps and set(steps) == {2}
        assert path.read_bytes() == b"\x00\x00"
    finally:
        llm.core.execute = execute


def test_prefill_stays_marked_busy_between_queued_forwards(llm, tmp_path, restore_threads):
    path = tmp_path / "cores"
    runner = PrefillRunner(llm.runtime, 32, cores=CoreShare(path, "prefill", own=1, total=2))

    def forward() -> None:
        seq = runner.new_sequence()
        runner.forward(seq, list(range(1, 20)), lambda layer: None, threading.Event())
        runner.release(seq)

    runner.expect()
    runner.expect()  # two prompts queued
    forward()
    assert path.read_bytes()[0] == 1  # the second is next: decode must not take every core now
    forward()
    assert path.read_bytes()[0] == 0
    runner.expect()
    runner.expect()
    forward()
    assert path.read_bytes()[0] == 1
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(Aborted):  # the queued one was cancelled before it ran: idle all the same
        runner.forward(runner.new_sequence(), [1, 2, 3], lambda layer: None, cancelled)
    assert path.read_bytes()[0] == 0


_PROMPT_ON_1_AND_2_THREADS = """
import hashlib, torch, sys
from kvwire.config import DEFAULT_MODEL_DIR
from kvwire.config import KVDtype, QuantMode
from kvwire.runtime import EngineConfig, load_engine
rt = load_engine(EngineConfig(DEFAULT_MODEL_DIR, weights=QuantMode.NONE, kv_dtype=KVDtype.FP8_E4M3, num_pages=64))
ids = list(range(20, 31))  # 11 tokens: a row count MKL splits differently on 1 and 2 threads
out = []
for threads in (1, 2):
    torch.set_num_threads(threads)
    cache = rt.new_cache()
    logits = rt.model(torch.tensor(ids), cache.prepare([0], [len(ids)]), cache)
    h = hashlib.sha256(logits.numpy().tobytes())
    for layer in range(rt.model_config.num_layers):
        for t in cache.layer_tensors(layer):
            if t is not None:
                h.update(t.view(torch.uint8).numpy().tobytes())
    out.append(h.hexdigest())
print(out[0] == out[1])
"""


def test_services_prefill_the_same_bits_on_any_thread_count():
    """Lending changes a service's thread count from one unit of work to the next, so a prompt's
    pages and logits must not depend on it: the services set MKL_CBWR (fp32 matmuls of the
    PyTorch path). Without it the same forward differs on CPUs where MKL picks per-thread-count
    kernels, which shows the check can fail; where MKL happens to agree without it, the test says
    so by skipping."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    run = lambda e: subprocess.run([sys.executable, "-c", _PROMPT_ON_1_AND_2_THREADS], env=e, check=True,  # noqa: E731
                                   capture_output=True, text=True).stdout.strip()
    services = dict(env)
    code = "import os; from kvwire_serving.cores import service_openmp_env; service_openmp_env(); print(os.environ['MKL_CBWR'])"
    services["MKL_CBWR"] = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                                          text=True).stdout.strip()
    assert run(services) == "True"
    if torch.backends.mkl.is_available() and run(env) == "True":
        pytest.skip("this CPU's MKL gives the same bits on 1 and 2 threads without MKL_CBWR too: "
                    "the check above passed but cannot show here that it would fail")
