"""Group-wise 4-bit weights from a float checkpoint (``--weights int4``, ``int4-awq``), as GGUF blocks.

A group of 32 input channels of one output row with its own fp16 scale (and minimum) is exactly a
GGUF Q4_1 block (Q4_0 without the minimum), so the quantized rows are written in that layout and run
on ``GGUFLinear`` and its kernels (decision 062). Round-to-nearest: per group, the scale and minimum
are rounded to fp16 first and every weight takes the nearest of the 16 levels they define, so the
blocks dequantize (``gguf.quants.dequantize``) to exactly ``fake_quant``'s values. lm_head takes Q8_0
blocks (llama.cpp's own quantizer). Group size and format: docs/decisions/066-int4-weights.md.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from kvwire.model.gguf_linear import GGUFLinear, native_shape

GROUP = 32  # input channels per scale: one GGUF block (the kernels' only 4-bit group size)
INT4_TYPE = "Q4_1"  # scale + minimum per group; see decision 066
HEAD_TYPE = "Q8_0"
LEVELS = 15  # 4 bits: levels 0..15


def int4_grid(w: torch.Tensor, group: int = GROUP, symmetric: bool = False, clip: torch.Tensor | None = None,
              dm: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] (in % group == 0) -> (q uint8 [out, in] in 0..15, d fp32 [out, in / group],
    m fp32 [out, in / group]) with w ~= d * q + m; d and m are fp16 values (the blocks store fp16).

    Asymmetric (Q4_1): d = (max - min) / 15, m = min. Symmetric (Q4_0): d = the largest-magnitude
    value / -8, m = -8 d, so that value is a level exactly (as llama.cpp's Q4_0 places it).
    ``clip`` [out, in / group] in (0, 1]: the group's range (its extremes) shrunk by that ratio first, the
    values beyond it taking the end levels (int4-awq's clipping search); None is round-to-nearest.
    ``dm``: each group's (d, m) [out, in / group] as given (fp16 values; int4-awq's fitted ones)."""
    out, n = w.shape
    g = w.float().reshape(out, n // group, group)  # [out, groups, group]
    r = 1.0 if clip is None else clip
    if dm is not None:
        d, m = dm
    elif symmetric:
        big = g.gather(2, g.abs().argmax(dim=2, keepdim=True))[..., 0] * r  # [out, groups], signed
        d = (big / -8).half().float()
        m = -8 * d
    else:
        lo, hi = g.amin(dim=2) * r, g.amax(dim=2) * r
        d = ((hi - lo) / LEVELS).half().float()
        m = lo.half().float()
    safe = torch.where(d != 0, d, torch.ones_like(d))
    q = torch.round((g - m[..., None]) / safe[..., None]).clamp_(0, LEVELS)  # the nearest level
    return q.to(torch.uint8).reshape(out, n), d, m


def fake_quant(w: torch.Tensor, group: int = GROUP, symmetric: bool = False, clip: torch.Tensor | None = None,
               dm: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """[out, in] fp32: the weights the int4 blocks of ``w`` dequantize to (d * q + m, in fp32)."""
    q, d, m = int4_grid(w, group, symmetric, clip, dm)
    out, n = w.shape
    g = q.reshape(out, n // group, group).float()
    return (d[..., None] * g + m[..., None]).reshape(out, n)


def q4_blocks(w: torch.Tensor, qtype: str = INT4_TYPE, clip: torch.Tensor | None = None,
              dm: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """w [out, in] -> uint8 [out, in / 32 * block bytes]: GGUF Q4_0 / Q4_1 rows of blocks
    (fp16 d, [fp16 m,] 16 bytes of quants: byte j holds value j low and value j + 16 high)."""
    if qtype not in ("Q4_0", "Q4_1"):
        raise ValueError(f"q4_blocks: {qtype} is not Q4_0 or Q4_1")
    q, d, m = int4_grid(w, GROUP, qtype == "Q4_0", clip, dm)
    out, n = w.shape
    qb = q.reshape(out, n // GROUP, GROUP)
    nib = qb[..., :16] | (qb[..., 16:] << 4)  # [out, blocks, 16]
    parts = [d.half().view(torch.uint8).reshape(out, -1, 2)]  # [out, blocks, 2] (fp16 little-endian bytes)
    if qtype == "Q4_1":
        parts.append(m.half().view(torch.uint8).reshape(out, -1, 2))
    return torch.cat([*parts, nib], dim=2).reshape(out, -1).contiguous()


def q8_0_blocks(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] -> uint8 [out, in / 32 * 34]: llama.cpp's Q8_0 (``gguf.quants.quantize``)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    return torch.from_numpy(quantize(w.float().numpy(), GGMLQuantizationType.Q8_0).astype(np.uint8, copy=False))


def block_layer(w: torch.Tensor, qtype: str, clip: torch.Tensor | None = None,
                dm: tuple[torch.Tensor, torch.Tensor] | None = None) -> GGUFLinear | None:
    """The GGUFLinear of ``w`` [out, in] in ``qtype`` blocks, or None where the kernels' shapes do not fit."""
    out, n = w.shape
    if w.device.type != "cpu" or not native_shape(qtype, out, n):
        return None
    raw = q8_0_blocks(w) if qtype == HEAD_TYPE else q4_blocks(w, qtype, clip, dm)
    return GGUFLinear(raw, qtype, n)


def int4_hook(fallback: Callable[[str, Sequence[torch.Tensor]], nn.Module | None], include_lm_head: bool = True
              ) -> Callable[[str, Sequence[torch.Tensor]], nn.Module | None]:
    """The loader's quantize hook: lm_head in Q8_0 blocks, every other Linear in INT4_TYPE blocks
    (rows are independent, so each piece is quantized on its own and the rows concatenated); a
    shape the kernels do not take goes to ``fallback`` (int8)."""
    def hook(name: str, pieces: Sequence[torch.Tensor]) -> nn.Module | None:
        if name == "lm_head" and not include_lm_head:
            return None
        qtype = HEAD_TYPE if name == "lm_head" else INT4_TYPE
        rows, cols = sum(p.shape[0] for p in pieces), pieces[0].shape[1]
        if pieces[0].device.type != "cpu" or not native_shape(qtype, rows, cols):
            return fallback(name, pieces)
        raw = torch.cat([q8_0_blocks(p) if qtype == HEAD_TYPE else q4_blocks(p, qtype) for p in pieces])
        return GGUFLinear(raw, qtype, cols)
    return hook
