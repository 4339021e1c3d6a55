"""Facts about the machine measured in the same run as the benchmarks that use them."""
from __future__ import annotations

import os
import platform
import time

import torch


def memory_bandwidth_gbs(mib: int = 1024, repeats: int = 5) -> float:
    """STREAM-style copy bandwidth (bytes read + bytes written per second), best of `repeats`."""
    a = torch.ones(mib << 18)  # mib MiB of float32
    b = torch.empty_like(a)
    b.copy_(a)  # touch the pages
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 4 / best / 1e9


def facts() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "memory_bandwidth_gbs": round(memory_bandwidth_gbs(), 2)}
