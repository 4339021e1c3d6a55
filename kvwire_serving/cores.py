"""Core lending between co-located services: prefill_svc and decode_svc on one host.

Two services on one host split its cores (``--threads``): OpenMP threads that outnumber the cores
stall each other at every barrier. A static split, though, leaves half the host idle whenever one
service has nothing to do: a lone prompt prefills on half the cores while decode waits for it,
and a decode batch runs on half the cores between prompts.

With ``--share-cores FILE`` both services map the same small file, one byte per role, that says
whether that role is computing. Before each unit of work (a prefill layer; a decode step, local
prefill or KV import) a service marks itself busy and reads the other byte: it computes on every usable core when the
other role is idle, on its own share (``--threads``) when not. Marking before reading means two
services starting at once see each other (x86 may reorder the store after the load, and then
both run one unit on all cores: a slower unit, never a wrong one). The file holds no state
beyond these bytes; a service that dies leaves its byte set and the other keeps to its share,
which is the static split again.

Only for processes on one host; services on their own pods or machines have their own cores and
need none of this.
"""
from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvwire.threads import use_threads  # noqa: F401 - the services' import point

ROLES = ("prefill", "decode")

# How long an OpenMP worker spins for more work before it sleeps, for libgomp (torch's and the CPU
# kernels'): its default, 300,000 rounds (milliseconds), keeps a worker on its core well after a
# decode step or prefill layer ends, while the service's event loop and gRPC threads need that
# core to send the token; 10,000 rounds still cover the gaps between a step's own parallel regions.
# Measured served on 2 cores, SmolLM2 int8, decode on 2 threads: ITL 17.6 ms at the default,
# 7.8 ms at 10,000 (in-process 7.1); OMP_WAIT_POLICY=PASSIVE (no spinning) gave 16.4 ms.
SERVICE_SPINCOUNT = "10000"


# MKL's strict conditional numerical reproducibility: fp32 matmuls (the PyTorch path's F.linear for
# fp32 weights) give the same bits on any thread count. Without it MKL splits some shapes
# differently on 1 and 2 threads (SmolLM2's 576-wide layers at 7 or 10 rows; the embedded model's
# 11-token chat prompt), so a prompt prefilled while the other service held a core got different
# pages than the same prompt prefilled alone, and greedy output changed between identical requests.
SERVICE_MKL_CBWR = "AUTO,STRICT"


def service_openmp_env() -> None:
    """Set the services' OpenMP spin and MKL's thread-count-independent mode (unless the
    environment already sets them). Effective only before torch is imported: libgomp and MKL read
    their environment once, when they are loaded."""
    os.environ.setdefault("GOMP_SPINCOUNT", SERVICE_SPINCOUNT)
    os.environ.setdefault("MKL_CBWR", SERVICE_MKL_CBWR)


def compute_executor(name: str) -> ThreadPoolExecutor:
    """The one thread a service computes on: loading, warm-up, every forward and step. libgomp
    gives each thread that starts parallel work a pool of its own, and a second pool (the warm-up
    on asyncio's default executor, the forwards on the service's) made every prefill forward in
    prefill_svc about 1.4x slower on 2 cores (SmolLM2 int8, 128 and 512 tokens). libgomp documents
    why: with more OpenMP threads than CPUs it spins only 100 rounds (1,000 with an active wait
    policy), so the working pool's workers sleep between parallel regions and each region starts
    by waking them."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)




class CoreShare:
    """One role's view of the shared flags: ``busy()`` before computing (returns the threads to
    use), ``idle()`` when there is nothing more to compute."""

    def __init__(self, path: Path, role: str, own: int, total: int):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if not 1 <= own <= total:
            raise ValueError(f"own share {own} must be between 1 and total {total}")
        self.path, self.role, self.own, self.total = Path(path), role, own, total
        self._me, self._others = ROLES.index(role), [i for i in range(len(ROLES)) if ROLES[i] != role]
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < len(ROLES):
                os.ftruncate(fd, len(ROLES))  # a new file: zeros, nobody busy
            self._map = mmap.mmap(fd, len(ROLES))
        finally:
            os.close(fd)
        self._map[self._me] = 0

    def busy(self) -> int:
        """Mark this role computing; the threads to compute with now."""
        self._map[self._me] = 1
        return self.own if any(self._map[i] for i in self._others) else self.total

    def idle(self) -> None:
        self._map[self._me] = 0
