"""Quantized drop-in replacements for ``kvwire.model.linear.Linear`` and ``quantize_model``.

Each layer keeps Linear's contract (fp32 [rows, in] -> fp32 [rows, out]) and is built at load time
from a weight it does not keep. The op depends on rows and CPU flags, never timing: int8 takes int8
activations in blocks of 32 on AVX512-VNNI CPUs and is weight-only elsewhere; fp8 is weight-only,
its exact bf16 image on CPU. lm_head stays as is unless ``include_lm_head`` (its logits feed
sampling directly; a tied table must stay intact). See docs/decisions/041-quantized-linear-paths.md.
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

from kvwire.config import QuantMode
from kvwire.model import int4
from kvwire.model.linear import Linear, cpu_has_native_bf16, upcast_linear
from kvwire.model.tuned import QUANT_BLOCK_ELEMS, UPCAST_MIN_ROWS, W8A8_LAYERS, W8A8_MIN_ROWS
from kvwire_kernels import cpu

# Weight modes whose engine also quantizes lm_head: int8, where the head is a large share of a step's
# reads; see docs/decisions/041-quantized-linear-paths.md.
# int4 / int4-awq / int4-gptq: Q8_0 blocks (kvwire.model.int4), as llama.cpp's 4-bit files keep a wider head.
HEAD_QUANTIZED = frozenset({QuantMode.INT8, QuantMode.GGUF, QuantMode.INT4, QuantMode.INT4_AWQ, QuantMode.INT4_GPTQ})
# fbgemm's reduce_range=True quantizes activations to 7 bits so that u8*s8 pair sums cannot
# saturate int16 on CPUs without VNNI (AVX2's vpmaddubsw). With VNNI (vpdpbusd, 32-bit sums) the
# full 8 bits are safe; the lost bit doubles the activation rounding error. Chosen from the CPU's
# flags, never from timing.
REDUCE_RANGE_WITHOUT_VNNI = True
# The CPU int8pack_mm kernel reads out of bounds unless in_features % 16 == 0 (torch 2.13: NaNs or a
# segfault); other shapes take the wide path.
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
    """Int8 weights with per-output-channel scales; see the module docstring for which op runs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 act_quant: bool = False, reduce_range: bool | None = None,
                 quantized: tuple[torch.Tensor, torch.Tensor] | None = None):
        # quantized: (q, scale) as quantize_int8(weight) gives them, already computed (the loader
        # quantizes a checkpoint's pieces as it reads them); weight is then ignored and may be None.
        super().__init__()
        q, scale = quantize_int8(weight) if quantized is None else quantized
        self.out_features, self.in_features = q.shape
        self.use_w8a8 = act_quant and q.device.type == "cpu"
        # On CPUs that multiply int8 by int8 (see vnni_layout) the weight is kept only in the layout
        # of kvw_gemm_i8a8, which every CPU call (prefill and the fused decode step) then takes;
        # elsewhere only [out, in]. One copy either way; int8_weight() gives [out, in] back.
        packed = None if self.use_w8a8 else vnni_layout(q)
        self.register_buffer("packed", packed)  # [out / 16, in / 4, 16, 4] uint8 (w ^ 0x80), or None
        self.register_buffer("weight", q if packed is None else None)  # [out, in] int8, or None
        self.register_buffer("scale", scale)  # [out] fp32
        self.register_buffer("bias", None if bias is None else bias.float())
        self.register_buffer("unit_scale", torch.ones(self.out_features, dtype=torch.bfloat16,
                                                      device=q.device), persistent=False)
        self.reduce_range = default_reduce_range() if reduce_range is None else reduce_range
        # Wide inputs: per-token W8A8 through fbgemm when use_w8a8 is set (layers whose input comes
        # straight out of an RMSNorm, see W8A8_LAYERS), weight-only otherwise. Tests and hosts
        # without a quantized engine set use_w8a8 False to force the weight-only path.
        self._packed = None  # fbgemm prepacked copy, built on the first wide call (see prepacked)

    def int8_weight(self) -> torch.Tensor:
        """The weight as [out, in] int8, whichever layout it is stored in."""
        if self.packed is None:
            return self.weight
        return cpu.unpack_i8a8(self.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] fp32 -> [rows, out] fp32
        if self.packed is not None and x.device.type == "cpu":
            return cpu.gemm_i8a8(x.float().contiguous(), self.packed, self.scale, self.bias)  # [rows, out] fp32
        if (x.shape[0] < W8A8_MIN_ROWS and x.device.type == "cpu"
                and self.in_features % INT8PACK_K_MULTIPLE == 0):
            return self._weight_only(x)
        if self.use_w8a8 and x.device.type == "cpu":
            packed = self.prepacked()
            if packed is not None:
                return self._w8a8_per_token(x, packed)
        return self._dequantized(x)

    def _weight_only(self, x: torch.Tensor) -> torch.Tensor:
        # The kernel wants activations and scales in one dtype, and fp32 activations take its scalar
        # reference loop, so activations go in as bf16 with unit scales and the fp32 per-channel
        # scales are applied to the [rows, out] result instead.
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.weight,
                                               self.unit_scale)  # [rows, out] bf16
        y = y * self.scale  # [rows, out] fp32 (bf16 * fp32 promotes: one pass, no float copy)
        return y if self.bias is None else y + self.bias

    def _w8a8_per_token(self, x: torch.Tensor, packed) -> torch.Tensor:
        # fbgemm's dynamic linear quantizes its input with one scale per tensor. Dividing each row
        # by its own absmax first makes that one scale (1/127 of the range [-1, 1]) a per-token
        # scale, and the matmul is linear in each row, so multiplying the output rows back is exact.
        amax = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30)  # [rows, 1]
        y = torch.ops.quantized.linear_dynamic((x / amax).contiguous(), packed, self.reduce_range)
        y = y * amax  # [rows, out]
        return y if self.bias is None else y + self.bias

    def _dequantized(self, x: torch.Tensor) -> torch.Tensor:
        # Weight-only int8 for wide inputs: int8 -> compute dtype a block of rows at a time (cheap
        # next to a wide matmul; no cached float copy, so the layer stays at 1 byte/param). bf16
        # where the CPU has native bf16 arithmetic (activations rounded to bf16, as decode's
        # int8pack_mm does), fp32 elsewhere; chosen from CPU flags, so every process agrees.
        dt = compute_dtype(x.device)
        y = upcast_linear(x.to(dt), self.int8_weight()) * self.scale  # [rows, out] fp32 (promoted)
        return y if self.bias is None else y + self.bias

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
                    # No bias in the packed weight: it is added after the per-token rescale.
                    self._packed = torch.ops.quantized.linear_prepack(qw, None)
            except (RuntimeError, NotImplementedError, AttributeError):
                self.use_w8a8 = False
        return self._packed


def vnni_layout(q: torch.Tensor) -> torch.Tensor | None:
    """int8 q [out, in] in kvw_gemm_i8a8's layout, or None where that kernel does not run: not on
    the CPU, no CPU kernels, no AVX512-VNNI or ``KVWIRE_INT8_ACTIVATIONS=0`` (the CPU's flags and
    the environment, never timing, so every process on a machine computes the same numbers), or
    a shape it does not take (out % 16, in % 64)."""
    if q.device.type != "cpu" or q.shape[0] % 16 or q.shape[1] % 64:
        return None
    return cpu.pack_i8a8(q) if cpu.int8_activations() else None


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype wide weight-only matmuls run in: bf16 on GPUs and on CPUs with native bf16."""
    return torch.bfloat16 if device.type != "cpu" or cpu_has_native_bf16() else torch.float32


@functools.cache
def default_reduce_range() -> bool:
    """fbgemm's 7-bit activations, on CPUs without VNNI only (see REDUCE_RANGE_WITHOUT_VNNI)."""
    vnni = bool(getattr(torch.cpu, "_is_vnni_supported", lambda: False)())
    return REDUCE_RANGE_WITHOUT_VNNI and not vnni


class Fp8Linear(nn.Module):
    """E4M3 weights (per-output-channel scales), weight-only: activations are not quantized."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 quantized: tuple[torch.Tensor, torch.Tensor] | None = None):
        # quantized: (q, scale) as quantize_fp8(weight) gives them (scale [out, 1]), already
        # computed; weight is then ignored and may be None. A bf16 q is taken as the e4m3 image.
        super().__init__()
        q, scale = quantize_fp8(weight) if quantized is None else quantized
        self.out_features, self.in_features = q.shape
        # CPU keeps the exact bf16 image of the e4m3 weight (see module docstring); GPUs keep e4m3.
        on_cpu = q.device.type == "cpu"
        self.register_buffer("weight", q.to(torch.bfloat16) if on_cpu else q)  # [out, in]
        self.register_buffer("scale", scale[:, 0])  # [out] fp32
        self.register_buffer("bias", None if bias is None else bias.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] fp32 -> [rows, out] fp32. e4m3 -> bf16/fp32 is exact, so this is the
        # e4m3 weight times bf16 (or fp32) activations, fp32 accumulation, scales on the product.
        if x.device.type == "cpu" and x.shape[0] >= UPCAST_MIN_ROWS and not cpu_has_native_bf16():
            acc = upcast_linear(x, self.weight)  # no native bf16: fp32 compute
        else:
            acc = upcast_linear(x.to(torch.bfloat16), self.weight).float()  # GPU: e4m3 -> bf16 blockwise
        y = acc * self.scale  # [rows, out]
        return y if self.bias is None else y + self.bias


def _as_loaded(mode: QuantMode) -> QuantMode:
    """gguf keeps a GGUF file's blocks at load time (kvwire.model.loader); a layer it cannot keep, or
    one built from anything else, is int8. int4-awq's scales (and int4-gptq's blocks) are made by the
    runtime (kvwire.model.awq, kvwire.model.gptq) before the rest is quantized: here it is int4's round-to-nearest."""
    if mode is QuantMode.GGUF:
        return QuantMode.INT8
    return QuantMode.INT4 if mode in (QuantMode.INT4_AWQ, QuantMode.INT4_GPTQ) else mode


def _quantized(lin: Linear, mode: QuantMode, name: str = "") -> nn.Module:
    w, b = lin.weight.detach(), None if lin.bias is None else lin.bias.detach()
    if mode is QuantMode.BF16:
        lin.weight = nn.Parameter(w.to(torch.bfloat16), requires_grad=False)
        return lin
    if mode is QuantMode.INT8:
        return Int8Linear(w, b, act_quant=name.endswith(W8A8_LAYERS))
    if mode is QuantMode.INT4:
        layer = int4.block_layer(w, int4.HEAD_TYPE if name == "lm_head" else int4.INT4_TYPE)
        if layer is None:  # a shape the block kernels do not take
            return Int8Linear(w, b)
        layer.bias = b if b is None else b.float()
        return layer
    return Fp8Linear(w, b)


@torch.no_grad()
def quantize_model(model: nn.Module, mode: QuantMode, include_lm_head: bool = False) -> nn.Module:
    """Swap every ``Linear`` in ``model`` (in place) for its ``mode`` version; returns ``model``.

    The original fp32/bf16 weight tensors are dropped as each layer is replaced (one layer's fp32
    copy at a time is the peak overhead). The embedding table is never touched, so tied
    embeddings stay intact whether or not lm_head is quantized.
    """
    mode = _as_loaded(QuantMode(mode))
    if mode is QuantMode.NONE:
        return model
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, Linear) and (include_lm_head or full != "lm_head"):
                setattr(module, child_name, _quantized(child, mode, full))
    return model


def quantize_pieces(pieces: Sequence[torch.Tensor], mode: QuantMode, name: str = "") -> nn.Module:
    """The ``mode`` layer of the matrix ``torch.cat(pieces).float()``, without building that matrix.

    Bit-identical to ``Int8Linear(w)`` / ``Fp8Linear(w)`` on the concatenated fp32 matrix: scales
    are per output row, so each piece is quantized on its own, a block of rows at a time
    (``QUANT_BLOCK_ELEMS``), from its checkpoint dtype (bf16/fp16 -> fp32 is exact). The largest
    float temporary is one block, not the matrix. ``name`` is the module's path (W8A8_LAYERS).
    The layer has no bias; set ``layer.bias`` (fp32) afterwards if the checkpoint has one.
    """
    mode = _as_loaded(QuantMode(mode))
    if mode not in (QuantMode.INT8, QuantMode.FP8):
        raise ValueError(f"quantize_pieces: mode {mode.value!r} is not int8 or fp8")
    fn = quantize_int8 if mode is QuantMode.INT8 else quantize_fp8
    device = pieces[0].device
    # fp8 on CPU: the bf16 image is what Fp8Linear stores (see the module docstring).
    qdtype = torch.int8 if mode is QuantMode.INT8 else torch.bfloat16 if device.type == "cpu" else FP8
    rows, cols = sum(p.shape[0] for p in pieces), pieces[0].shape[1]
    q = torch.empty(rows, cols, dtype=qdtype, device=device)  # [out, in], filled a block at a time
    scale = torch.empty(rows, dtype=torch.float32, device=device)  # [out]
    step, row = max(1, QUANT_BLOCK_ELEMS // max(1, cols)), 0
    for piece in pieces:  # piece: [rows_i, in], any float dtype
        for start in range(0, piece.shape[0], step):
            qb, sb = fn(piece[start:start + step])
            q[row:row + qb.shape[0]].copy_(qb)  # e4m3 -> bf16 is exact
            scale[row:row + qb.shape[0]] = sb.reshape(-1)
            row += qb.shape[0]
            del qb, sb
    if mode is QuantMode.FP8:
        scale = scale[:, None]  # [out, 1], as quantize_fp8 gives it
    if mode is QuantMode.INT8:
        return Int8Linear(None, quantized=(q, scale), act_quant=name.endswith(W8A8_LAYERS))
    return Fp8Linear(None, quantized=(q, scale))


def load_quantizer(mode: QuantMode, include_lm_head: bool = False
                   ) -> Callable[[str, Sequence[torch.Tensor]], nn.Module | None] | None:
    """The loader's hook (``load_model(quantize=...)``) that builds each Linear as the ``mode``
    layer straight from the checkpoint's pieces, so the model never exists in fp32; the same
    layers ``quantize_model(model, mode, include_lm_head)`` gives after a fp32 load. None for
    modes the loader's dtype already covers (none, bf16)."""
    mode = _as_loaded(QuantMode(mode))
    if mode not in (QuantMode.INT8, QuantMode.FP8, QuantMode.INT4):
        return None
    if mode is QuantMode.INT4:
        return int4.int4_hook(load_quantizer(QuantMode.INT8, include_lm_head), include_lm_head)

    def hook(name: str, pieces: Sequence[torch.Tensor]) -> nn.Module | None:
        if name == "lm_head" and not include_lm_head:
            return None
        return quantize_pieces(pieces, mode, name)
    return hook


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
