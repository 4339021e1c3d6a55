"""Facts about the machine measured in the same run as the benchmarks that use them.

The CPU's instruction sets are read from /proc/cpuinfo every run (machines of the
same kind differ: some are AVX2-only, some have AVX-512 with BF16/VNNI), and memory bandwidth is measured here, not
copied from a document. The load average is recorded too: on a shared 2-core machine, torch's
2 OpenMP threads slow small ops down by orders of magnitude when other processes hold a core.
"""
from __future__ import annotations

import os
import platform
import time

import torch

ISA = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8")


def _best_s(fn, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls, after one untimed call (pages touched)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def memory_bandwidth_gbs(mib: int = 256, repeats: int = 5) -> float:
    """STREAM-style copy bandwidth (bytes read + bytes written per second), best of `repeats`."""
    a = torch.ones(mib << 18)  # mib MiB of float32
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / _best_s(lambda: b.copy_(a), repeats) / 1e9


def read_bandwidth_gbs(mib: int = 256, repeats: int = 5) -> float:
    """Bytes read per second summing a buffer far larger than the caches, best of `repeats`: what a
    decode step does with its weights, so the roofline is put against this, not the copy figure
    (on some machines a copy runs at half the read rate: writes cost more than reads there)."""
    a = torch.ones(mib << 18)  # mib MiB of float32
    return a.numel() * 4 / _best_s(a.sum, repeats) / 1e9


def gpu_read_bandwidth_gbs(device: str, mib: int = 4096, repeats: int = 10) -> float:
    """The same read figure on a CUDA device (a buffer far larger than its L2), synchronised."""
    a = torch.ones(mib << 18, device=device)

    def read():
        a.sum()
        torch.cuda.synchronize(device)
    return a.numel() * 4 / _best_s(read, repeats) / 1e9


def gpu_info(device: str) -> dict:
    """Name, memory and measured read bandwidth of the CUDA device the benchmark runs on."""
    p = torch.cuda.get_device_properties(device)
    return {"gpu": p.name, "gpu_memory_gib": round(p.total_memory / 2**30, 1), "gpu_sms": p.multi_processor_count,
            "cuda": torch.version.cuda, "gpu_read_bandwidth_gbs": round(gpu_read_bandwidth_gbs(device), 1)}


def cpu_info() -> dict:
    """Model name, family / model numbers and instruction sets. A virtual machine may show only
    "AMD EPYC" as its name: the family tells the generations apart (AMD family 25 = Zen 3/4, where a
    512-bit instruction takes two passes; 26 = Zen 5, full width), which move kernel figures a lot."""
    model, flags, ids = platform.processor() or platform.machine(), set(), {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name":
                model = value.strip()
            elif key == "flags":
                flags = set(value.split())
            elif key in ("cpu family", "model") and value.strip().isdigit():
                ids.setdefault("cpu_family" if key == "cpu family" else "cpu_model", int(value))
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {"cpu": model, **ids, "isa": [f for f in ISA if f in flags], "memory_gib": round(mem / 2**30, 1)}


def cpu_name(f: dict) -> str:
    """'AMD EPYC (family 25, model 17)': the name with the numbers that tell its generation."""
    if "cpu_family" not in f:
        return f["cpu"]
    return f"{f['cpu']} (family {f['cpu_family']}, model {f.get('cpu_model', '-')})"


def facts(bandwidth: bool = True, device: str = "cpu") -> dict:
    gpu = gpu_info(device) if device.startswith("cuda") else {}
    return {**gpu, **cpu_info(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "memory_bandwidth_gbs": round(memory_bandwidth_gbs(), 2) if bandwidth else None,
            "read_bandwidth_gbs": round(read_bandwidth_gbs(), 2) if bandwidth else None}


def roofline_gbs(f: dict) -> float:
    """The bandwidth a decode step's roofline is put against: the read figure (reports written
    before it was measured: the copy figure); the GPU's when the benchmark ran on one."""
    return f.get("gpu_read_bandwidth_gbs") or f.get("read_bandwidth_gbs") or f["memory_bandwidth_gbs"]


def describe(f: dict) -> str:
    bw = f"{f['memory_bandwidth_gbs']} GB/s copy bandwidth" if f.get("memory_bandwidth_gbs") \
        else "bandwidth not measured"
    if f.get("read_bandwidth_gbs"):
        bw += f", {f['read_bandwidth_gbs']} GB/s read bandwidth (both measured in this run; rooflines use the read one)"
    elif f.get("memory_bandwidth_gbs"):
        bw += " (measured in this run)"
    gpu = (f"GPU: {f['gpu']} ({f['gpu_memory_gib']} GiB, {f['gpu_sms']} SMs, CUDA {f['cuda']}), "
           f"{f['gpu_read_bandwidth_gbs']} GB/s read bandwidth measured in this run (rooflines use it). "
           if f.get("gpu") else "")
    return gpu + (f"Machine: {cpu_name(f)}, {f['cores']} cores ({f['torch_threads']} torch threads), "
            f"{f['memory_gib']} GiB, ISA {' '.join(f['isa']) or '-'}; {bw}; torch {f['torch']}; "
            f"1-minute load average {f.get('load_avg_1m', '-')} at the start (other work on the shared CPU).")
