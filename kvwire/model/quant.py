"""Quantized drop-in replacements for ``kvwire.model.linear.Linear`` and ``quantize_model``.

Every layer keeps Linear's contract, ``forward(x fp32 [rows, in]) -> fp32 [rows, out]``, and is
built at load time from the checkpoint's fp32/bf16 weight, which it does not keep. Which op runs
(numbers in the comments below and ../../shared/MEASURED.md; "decode" = few rows; the CUDA
lines have not yet been run on a GPU):

mode  rows                   op                                               numerics
bf16  < UPCAST_MIN_ROWS      bf16 F.linear (Linear)                           W16A16
      >= UPCAST_MIN_ROWS     bf16 weight upcast to fp32, fp32 F.linear        W16A32
int8  < W8A8_MIN_ROWS        aten._weight_int8pack_mm(x bf16, w int8)         W8A16, fp32 scales
      >= W8A8_MIN_ROWS, CPU  quantized::linear_dynamic (fbgemm, prepacked)    W8A8, per-tensor act.
      fallback / no engine   int8 weight -> fp32 per call, fp32 F.linear      W8A32
      (CUDA: the fallback line for every row count, until checked on a GPU)
      (in_features % 16 != 0: no int8pack_mm; every row count takes the W8A8/fallback line)
fp8   CUDA, dims % 16 == 0   torch._scaled_mm(e4m3, e4m3, rowwise scales)     W8A8, per-token act.
      CPU (and fallback)     the same W8A8 emulated: activations rounded      W8A8 (same values)
                             per token to e4m3, times the e4m3 weight held
                             as its exact bf16 image; bf16 matmul for decode
                             rows, fp32 for wide ones

Why fp8 on CPU is emulated: this CPU has no fp8 arithmetic; ``torch._scaled_mm`` does run on CPU
with rowwise scales and gives the same result, but ~50x slower than an fp32 gemv, and converting
e4m3 -> bf16/fp32 is a scalar loop (~40-60 ms per 11.5 M values), so any per-call dequantization
costs more than the matmul. Every e4m3 value is exactly representable in bf16, so on CPU the
weight is stored once as that bf16 image (2 bytes/param, lossless; ``.to(float8_e4m3fn)`` gives
the e4m3 bytes back) and decode runs at bf16 speed.

lm_head is NOT quantized by default (``include_lm_head=False``): its output is the logits that
sampling and speculative acceptance read directly, with no later layer to average the error away,
and with tied embeddings a quantized head is a second copy next to the embedding table (which must
stay intact for the lookup). Pass ``include_lm_head=True`` to trade that for decode bandwidth.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from kvwire.config import QuantMode
from kvwire.model.linear import UPCAST_MIN_ROWS, Linear, upcast_linear

# int8: rows at or above which the fbgemm W8A8 kernel runs instead of weight-only int8pack_mm.
# int8pack_mm's cost jumps from 8 rows on (2048x5632, 1 thread: ~1.5 ms for 1-4 rows, ~5 ms at
# 8, ~9 ms at 32), while fbgemm stays at 0.6-2 ms. NB: on this AVX512-VNNI host fbgemm also beat
# int8pack_mm at 1 row (0.6 vs 1.7 ms), at ~1.3% error instead of ~0.8% (per-token scale at 1 row).
W8A8_MIN_ROWS = 8
# fbgemm's reduce_range=True quantizes activations to 7 bits so that u8*s8 pair sums cannot
# saturate int16 on CPUs without VNNI. Off: the lost bit doubles the activation rounding error
# (2048x512 layer, 64 rows, relative output error: gaussian 1.3% vs 2.1%, 1% outlier channels x20
# 7.1% vs 14.0%), while saturation, simulated for AVX2, hit ~1e-5 of pairs and added 0.1%.
REDUCE_RANGE = False
# The CPU int8pack_mm kernel reads out of bounds unless in_features % 16 == 0 (torch 2.13: NaNs,
# or a segfault for 3+ rows, at in_features 8, 24, 40, 100, 2056); other shapes take the fallback.
INT8PACK_K_MULTIPLE = 16
INT8_MAX, FP8_MAX = 127.0, float(torch.finfo(torch.float8_e4m3fn).max)  # 448
FP8 = torch.float8_e4m3fn


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: w [out, in] -> (q int8 [out, in], scale fp32 [out]), w ~= q * scale."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX  # [out]
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3: x [rows, n] -> (q e4m3 [rows, n], scale fp32 [rows, 1]), x ~= q * scale.

    Used per output channel for weights and per token for activations (round to nearest even).
    """
    x = x.float()
    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # [rows, 1]
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


class Int8Linear(nn.Module):
    """Weight-only int8 (per-output-channel scales) for decode; int8 W8A8 for wide inputs on CPU."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 reduce_range: bool = REDUCE_RANGE):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scale = quantize_int8(weight)
        self.register_buffer("weight", q)  # [out, in] int8
        self.register_buffer("scale", scale)  # [out] fp32
        self.register_buffer("bias", None if bias is None else bias.float())
        self.register_buffer("unit_scale", torch.ones(self.out_features, dtype=torch.bfloat16,
                                                      device=weight.device), persistent=False)
        self.reduce_range = reduce_range
        # Tests and hosts without a quantized engine set this False to force the fallback.
        self.use_w8a8 = weight.device.type == "cpu"
        self._packed = None  # fbgemm prepacked copy, built on the first wide call (see prepacked)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] fp32 -> [rows, out] fp32
        if (x.shape[0] < W8A8_MIN_ROWS and x.device.type == "cpu"
                and self.in_features % INT8PACK_K_MULTIPLE == 0):
            return self._weight_only(x)
        if self.use_w8a8 and x.device.type == "cpu":
            packed = self.prepacked()
            if packed is not None:
                return torch.ops.quantized.linear_dynamic(x.contiguous(), packed, self.reduce_range)
        return self._dequantized(x)

    def _weight_only(self, x: torch.Tensor) -> torch.Tensor:
        # The kernel wants activations and scales in one dtype; fp32 activations take a scalar
        # reference loop (~50x slower), so activations go in as bf16 with unit scales and the
        # fp32 per-channel scales are applied to the [rows, out] result instead.
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.weight,
                                               self.unit_scale)  # [rows, out] bf16
        y = y.float() * self.scale  # [rows, out]
        return y if self.bias is None else y + self.bias

    def _dequantized(self, x: torch.Tensor) -> torch.Tensor:
        # Fallback: int8 -> x.dtype per call, blockwise (cheap next to a wide matmul); no cached
        # float copy, so the layer stays at 1 byte/param.
        y = upcast_linear(x, self.weight) * self.scale.to(x.dtype)  # [rows, out]
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def prepacked(self):
        """The fbgemm packed weight (about as many bytes again as ``weight``), or None if the
        quantized engine is unavailable. Built lazily so decode-only replicas never hold it."""
        if self._packed is None and self.use_w8a8:
            try:
                with warnings.catch_warnings():
                    # torch marks quantized-tensor constructors deprecated; this is the one use,
                    # behind this dispatcher with a tested fallback.
                    warnings.simplefilter("ignore", UserWarning)
                    qw = torch._make_per_channel_quantized_tensor(
                        self.weight, self.scale.double(),
                        torch.zeros(self.out_features, dtype=torch.long), 0)
                    self._packed = torch.ops.quantized.linear_prepack(qw, self.bias)
            except (RuntimeError, NotImplementedError, AttributeError):
                self.use_w8a8 = False
        return self._packed


class Fp8Linear(nn.Module):
    """E4M3 weights (per-output-channel scales) x E4M3 activations (per-token scales)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scale = quantize_fp8(weight)
        # CPU keeps the exact bf16 image of the e4m3 weight (see module docstring); GPUs keep e4m3.
        on_cpu = weight.device.type == "cpu"
        self.register_buffer("weight", q.to(torch.bfloat16) if on_cpu else q)  # [out, in]
        self.register_buffer("scale", scale[:, 0])  # [out] fp32
        self.register_buffer("bias", None if bias is None else bias.float())
        # Whether to call torch._scaled_mm; on CPU it is correct but slow, so off unless forced.
        self.use_scaled_mm = not on_cpu
        aligned = self.in_features % 16 == 0 and self.out_features % 16 == 0
        self._scaled_mm_ok = aligned or on_cpu  # CUDA needs both dims % 16; unset after a failure

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] fp32 -> [rows, out] fp32
        xq, xs = quantize_fp8(x)  # [rows, in] e4m3, [rows, 1] fp32
        y = None
        if self.use_scaled_mm and self._scaled_mm_ok:
            y = self._scaled_mm(xq, xs)
        if y is None:
            y = self._emulated(xq, xs)
        return y if self.bias is None else y + self.bias

    def _scaled_mm(self, xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor | None:
        w = self.weight if self.weight.dtype == FP8 else self.weight.to(FP8)  # exact
        # CUDA rowwise scaling wants fp32 scales [rows, 1] and [1, out], the second operand
        # column-major (w is row-major [out, in], so w.t() is) and a bf16 output; CPU takes fp32.
        out_dtype = torch.float32 if xq.device.type == "cpu" else torch.bfloat16
        try:
            y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=self.scale[None, :],
                                 out_dtype=out_dtype)
        except (RuntimeError, NotImplementedError):
            self._scaled_mm_ok = False  # e.g. a GPU without fp8 (pre-sm89): emulate from now on
            return None
        return y.float()  # [rows, out]

    def _emulated(self, xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        # Same values as _scaled_mm: e4m3 -> bf16/fp32 is exact, scales applied to the product.
        w = self.weight if self.weight.dtype == torch.bfloat16 else self.weight.to(torch.bfloat16)
        if xq.shape[0] < UPCAST_MIN_ROWS or w.device.type != "cpu":
            acc = F.linear(xq.to(torch.bfloat16), w).float()  # fp32 accumulate, bf16 output
        else:  # fp32 accumulate *and* output, as _scaled_mm gives (a bf16 matmul rounds its output)
            acc = upcast_linear(xq.float(), w)
        return acc * xs * self.scale  # [rows, out]


def _quantized(lin: Linear, mode: QuantMode) -> nn.Module:
    w, b = lin.weight.detach(), None if lin.bias is None else lin.bias.detach()
    if mode is QuantMode.BF16:
        lin.weight = nn.Parameter(w.to(torch.bfloat16), requires_grad=False)
        return lin
    if mode is QuantMode.INT8:
        return Int8Linear(w, b)
    return Fp8Linear(w, b)


@torch.no_grad()
def quantize_model(model: nn.Module, mode: QuantMode, include_lm_head: bool = False) -> nn.Module:
    """Swap every ``Linear`` in ``model`` (in place) for its ``mode`` version; returns ``model``.

    The original fp32/bf16 weight tensors are dropped as each layer is replaced (one layer's fp32
    copy at a time is the peak overhead). The embedding table is never touched, so tied
    embeddings stay intact whether or not lm_head is quantized.
    """
    mode = QuantMode(mode)
    if mode is QuantMode.NONE:
        return model
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, Linear) and (include_lm_head or full != "lm_head"):
                setattr(module, child_name, _quantized(child, mode))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of all weights as stored (parameters and persistent buffers; shared storage counted
    once, so tied embeddings count once). This is what one forward pass streams at batch 1. The
    fbgemm prepacked copies of Int8Linear (built on the first wide call) are not included."""
    seen, total = set(), 0
    for t in model.state_dict(keep_vars=True).values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape))
        if t.device.type != "meta" and key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
