"""The dense linear layer the model is built from: weights fp32 or bf16, activations fp32.

bf16 weights over many rows run a bf16 matmul where the CPU has native bf16 (AVX512-BF16 / AMX) and
are upcast to fp32 a block at a time elsewhere; fewer rows take the CPU kernels' fp32 sums, since a
bf16 output would round near-tied logits into ties. The choice comes from the CPU's flags (and
``KVWIRE_CPU_KERNELS``), never from timing, so every process on a machine computes the same numbers;
see docs/decisions/042-bf16-linear-and-loading.md. On a GPU activations take the weights' dtype.
Quantized replacements (kvwire.model.quant) keep the same ``forward(x) -> y`` contract.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kvwire.model.tuned import UPCAST_BLOCK_BYTES, UPCAST_MIN_ROWS
from kvwire_kernels import cpu


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
    return any(bool(getattr(torch.cpu, flag, lambda: False)()) for flag in
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
