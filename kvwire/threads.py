"""How many threads this process computes on: the CPUs it may use, and torch's thread count
(which the CPU kernels follow)."""
from __future__ import annotations

import os
from pathlib import Path


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota (a
    Kubernetes CPU limit of 1.5 gives 1: a thread more than the quota is throttled mid-barrier)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return n


def use_threads(n: int) -> None:
    """Compute with ``n`` threads from now on (torch's count, which the CPU kernels follow)."""
    import torch  # deferred: torch-free processes (the tokenizer service) import this module

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
