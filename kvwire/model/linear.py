"""The dense linear layer the model is built from.

Weights may be fp32 or bf16; activations arrive in fp32. A one-row (decode) bf16 matmul streams
the weights at full memory bandwidth everywhere. Over many rows (prefill) it depends on the CPU:
without native bf16 arithmetic (no AVX512-BF16 / AMX) it is ~5x slower
than fp32, so bf16 weights are upcast; with it (this project's CI machines report AVX512-BF16)
the bf16 matmul is ~3.5x faster than the upcast, so the activations are cast to bf16 instead.
That matmul rounds its output to bf16 (8 bits of mantissa: logits near 25 land on steps of 0.125,
so two tokens tie and greedy decoding picks by index). Below ``UPCAST_MIN_ROWS`` rows, where the
weights' bandwidth decides the speed anyway, the CPU kernels (``kvwire_kernels/cpu``) multiply bf16
weights by fp32 activations with fp32 sums and output instead, when they are built.
The choice comes from the CPU's feature flags (and whether the CPU kernels are built, which
``KVWIRE_CPU_KERNELS=0`` turns off), never from timing, so every process on a machine computes the
same numbers. On a GPU the activations are cast to the weights' dtype.
Quantized replacements (kvwire.model.quant) keep the same ``forward(x) -> y`` contract.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kvwire_kernels import cpu

# Rows at or above which a bf16 weight is upcast to fp32 for the matmul (compute-bound regime).
UPCAST_MIN_ROWS = 16
# Bytes of converted weight per block. A whole 2048x5632 fp32 copy is past glibc's mmap threshold,
# so every call page-faults it in fresh (~35 ms, vs ~2 ms for the conversion); 4 MiB blocks are
# reused from the heap and stay near full matmul speed. Small models fit in one block (SmolLM2's
# 3072x576 gate_up in bf16 is 3.4 MiB), so their wide matmuls need no concatenation.
UPCAST_BLOCK_BYTES = 4 << 20


def upcast_block_rows(w: torch.Tensor, dtype: torch.dtype) -> int:
    """Output rows of ``w`` converted to ``dtype`` at a time (at least 64)."""
    return max(64, UPCAST_BLOCK_BYTES // (w.shape[1] * dtype.itemsize))


def upcast_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ w[out, in].T in x's dtype, converting w a block of rows at a time."""
    block = upcast_block_rows(w, x.dtype)
    if w.shape[0] <= block:
        return F.linear(x, w.to(x.dtype))
    return torch.cat([F.linear(x, w[i:i + block].to(x.dtype))
                      for i in range(0, w.shape[0], block)], dim=1)  # [rows, out]


@functools.cache
def cpu_has_native_bf16() -> bool:
    cpu = torch.cpu
    return any(bool(getattr(cpu, flag, lambda: False)()) for flag in
               ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def _cpu_kernels(w: torch.Tensor):
    """The CPU kernels module when it can multiply ``w`` (contiguous, on the CPU), else None."""
    if w.device.type != "cpu" or not w.is_contiguous():
        return None
    return cpu if cpu.available() else None  # the kernels build on first use


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in_features] fp32 -> [rows, out_features] fp32
        w = self.weight
        if w.dtype == x.dtype:
            return F.linear(x, w, self.bias)
        few_rows = x.shape[0] < UPCAST_MIN_ROWS
        if few_rows and w.dtype == torch.bfloat16 and x.dtype == torch.float32 and (kernels := _cpu_kernels(w)):
            b = None if self.bias is None else self.bias.float()
            return kernels.linear(x.contiguous(), w, bias=b)  # [rows, out] fp32, fp32 sums
        if not few_rows and w.device.type == "cpu" and not cpu_has_native_bf16():
            y = upcast_linear(x, w)
            return y if self.bias is None else y + self.bias.to(x.dtype)
        b = None if self.bias is None else self.bias.to(w.dtype)
        return F.linear(x.to(w.dtype), w, b).to(x.dtype)
