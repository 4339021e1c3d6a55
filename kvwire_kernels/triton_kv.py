"""Triton kernels for KV pages, with the signatures of ``kvwire_kernels.reference`` (the spec).

Pages are read and written through integer views with explicit round-to-nearest-even bit
arithmetic, never Triton's fp8/bf16 casts (the interpreter truncates where torch rounds, and
``tl.float8e4nv`` needs sm_89), and divisions feeding a rounding use ``tl.math.div_rn``: writes
equal torch's bytes everywhere. Attention sums in another order: equal within float32 round-off.
Precondition: page and scale tensors are contiguous.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvwire_kernels.reference import FP8_MAX, SCALE_FLOOR


# Reductions are tl.reduce with triton's own combine functions rather than tl.sum / tl.max: those
# two are triton.jit functions decorated when triton is first imported, so under TRITON_INTERPRET=1
# they fail unless the variable was set before any `import triton` in the process (transformers
# imports triton on its own). The combine functions are never called as such by the interpreter
# (it recognizes them and uses numpy) and compile exactly like tl.sum / tl.max on a GPU.
_add = tl.standard._sum_combine
_max = tl.standard._elementwise_max


@triton.jit
def _pow2(e):
    """2.0 ** e for int32 e in the normal float32 range, exactly."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_e4m3_bits(x):
    """float32 (already scaled) -> e4m3fn bits as int32: saturate to +-448, round half to even."""
    ax = tl.minimum(tl.abs(x), 448.0)
    exp = ((ax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(exp, -6)  # e4m3: 3 mantissa bits, subnormal below 2**-6
    spacing = _pow2(e - 3)
    y = ax * _pow2(3 - e)  # ax / spacing, exactly (a power of two)
    r = tl.floor(y + 0.5)
    r = tl.where((r - y == 0.5) & (r - 2.0 * tl.floor(r * 0.5) == 1.0), r - 1.0, r)  # ties to even
    q = r * spacing  # exactly representable in e4m3
    qb = q.to(tl.int32, bitcast=True)
    qexp = ((qb >> 23) & 0xFF) - 127
    normal = ((qexp + 7) << 3) | ((qb >> 20) & 7)
    sub = (q * 512.0).to(tl.int32)  # multiples of 2**-9
    bits = tl.where(q >= 0.015625, normal, sub)
    return tl.where(x.to(tl.int32, bitcast=True) < 0, bits | 0x80, bits)  # sign bit: -0.0 too, as torch


@triton.jit
def _e4m3_bits_to_f32(b):
    """e4m3fn bits (int32, 0..255) -> float32, exactly (the NaN pattern is never written)."""
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * _pow2(e - 10))
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def _f32_to_bf16_bits(x):
    b = x.to(tl.uint32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16)  # round half to even


@triton.jit
def _bf16_bits_to_f32(h):
    return ((h.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _load_page_f32(pages, scales, page, h, rows, d, mask, num_kv_heads,
                   BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, IS_FP8: tl.constexpr):
    """[len(rows), len(d)] float32 of page ``page``, kv-head ``h`` (int pages: see module doc)."""
    head = page.to(tl.int64) * num_kv_heads + h
    raw = tl.load(pages + head * (BLOCK * HEAD_DIM) + rows[:, None] * HEAD_DIM + d[None, :],
                  mask=mask, other=0).to(tl.int32)
    if IS_FP8:
        # A released page (-1) reads no scales; (rows * 0 + page): the interpreter refuses a
        # scalar condition broadcast into a vector mask.
        smask = ((rows * 0 + page) >= 0) & (rows < BLOCK)
        s = tl.load(scales + head * BLOCK + rows, mask=smask, other=0)
        return _e4m3_bits_to_f32(raw & 0xFF) * _bf16_bits_to_f32(s)[:, None]
    return _bf16_bits_to_f32(raw)


@triton.jit
def _write_kernel(pages, scales, new, slots, num_kv_heads, stride_nt, stride_nh,
                  BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  IS_FP8: tl.constexpr, FMAX: tl.constexpr, FLOOR: tl.constexpr):
    # One program per (token, kv-head), each writing only its own slot (format 2 is
    # append-only: a token's scale depends on its own values), so no program reads another's
    # output and tokens may come in any order.
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    slot = tl.load(slots + t)
    head = (slot // BLOCK) * num_kv_heads + h
    dst = pages + head * (BLOCK * HEAD_DIM) + (slot % BLOCK) * HEAD_DIM + d
    x = tl.load(new + t.to(tl.int64) * stride_nt + h * stride_nh + d, mask=dmask, other=0.0).to(tl.float32)
    if IS_FP8:
        amax = tl.reduce(tl.abs(x), 0, _max)
        bits = tl.maximum(tl.math.div_rn(amax, FMAX), FLOOR).to(tl.int32, bitcast=True)
        bits = (bits & -65536) + ((bits & 0xFFFF) != 0).to(tl.int32) * 65536  # round up to bf16
        scale = bits.to(tl.float32, bitcast=True)
        tl.store(dst, _f32_to_e4m3_bits(tl.math.div_rn(x, scale)).to(tl.uint8), mask=dmask)
        tl.store(scales + head * BLOCK + slot % BLOCK, (bits >> 16).to(tl.int16))
    else:
        tl.store(dst, _f32_to_bf16_bits(x), mask=dmask)


def _int_view(pages: torch.Tensor) -> torch.Tensor:
    assert pages.is_contiguous(), "page and scale tensors must be contiguous"
    return pages.view(torch.uint8 if pages.dtype == torch.float8_e4m3fn else torch.int16)


def write_kv(k_pages, v_pages, k_scale, v_scale, k_new, v_new, slot_mapping) -> None:
    """See ``kvwire_kernels.reference.write_kv``."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    _, num_kv_heads, block, head_dim = k_pages.shape
    is_fp8 = k_pages.dtype == torch.float8_e4m3fn
    slots = slot_mapping.to(torch.int64).contiguous()
    for pages, scales, new in ((k_pages, k_scale, k_new), (v_pages, v_scale, v_new)):
        assert new.stride(-1) == 1
        _write_kernel[(num_tokens, num_kv_heads)](
            _int_view(pages), _int_view(scales) if is_fp8 else pages, new, slots, num_kv_heads,
            new.stride(0), new.stride(1), BLOCK=block, HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim), IS_FP8=is_fp8, FMAX=FP8_MAX, FLOOR=SCALE_FLOOR)


@triton.jit
def _dequant_kernel(pages, scales, page_ids, out, num_kv_heads, BLOCK: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
                    IS_FP8: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, BLOCK_B)
    d = tl.arange(0, BLOCK_D)
    mask = (rows < BLOCK)[:, None] & (d < HEAD_DIM)[None, :]
    page = tl.load(page_ids + i)
    vals = _load_page_f32(pages, scales, page, h, rows, d, mask, num_kv_heads, BLOCK, HEAD_DIM, IS_FP8)
    dst = out + (i.to(tl.int64) * num_kv_heads + h) * (BLOCK * HEAD_DIM)
    tl.store(dst + rows[:, None] * HEAD_DIM + d[None, :], vals, mask=mask)


def dequantize_pages(pages, scales, page_ids) -> torch.Tensor:
    """See ``kvwire_kernels.reference.dequantize_pages``: float32 [n, num_kv_heads, block_size, head_dim]."""
    _, num_kv_heads, block, head_dim = pages.shape
    ids = page_ids.to(torch.int64).contiguous()
    out = torch.empty((ids.numel(), num_kv_heads, block, head_dim), dtype=torch.float32,
                      device=pages.device)
    if ids.numel():
        is_fp8 = pages.dtype == torch.float8_e4m3fn
        _dequant_kernel[(ids.numel(), num_kv_heads)](
            _int_view(pages), _int_view(scales) if is_fp8 else pages, ids, out, num_kv_heads, BLOCK=block,
            HEAD_DIM=head_dim, BLOCK_B=triton.next_power_of_2(block),
            BLOCK_D=triton.next_power_of_2(head_dim), IS_FP8=is_fp8)
    return out


@triton.jit
def _decode_attn_kernel(q, k_pages, v_pages, k_scale, v_scale, tables, ctx_lens, out, sm_scale,
                        window, num_kv_heads, max_blocks, stride_qs, stride_qh, stride_os, stride_oh,
                        RATIO: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
                        HAS_WINDOW: tl.constexpr, IS_FP8: tl.constexpr):
    # One program per (sequence, kv-head): its RATIO query heads share every K/V page load
    # (that is GQA's saving). Online softmax over the visible pages, one page per iteration.
    s = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_B)
    qmask = (r < RATIO)[:, None] & (d < HEAD_DIM)[None, :]
    heads = h * RATIO + r
    qv = tl.load(q + s.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + d[None, :],
                 mask=qmask, other=0.0).to(tl.float32) * sm_scale  # [BLOCK_R, BLOCK_D]
    ctx = tl.load(ctx_lens + s)
    p = ctx - 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(p - window + 1, 0)  # pages before lo may be released (-1): never read
    m_i = tl.full([BLOCK_R], -1e30, tl.float32)
    l_i = tl.full([BLOCK_R], 0.0, tl.float32)  # tl.full, not tl.zeros: see _add above
    acc = tl.full([BLOCK_R, BLOCK_D], 0.0, tl.float32)
    for b in range(lo // BLOCK, (ctx + BLOCK - 1) // BLOCK):
        page = tl.load(tables + s.to(tl.int64) * max_blocks + b)
        pos = b * BLOCK + rows
        # A released page (-1) is never read, whatever the window says: an out-of-bounds load
        # would be an illegal address on a GPU (seen when a table had lost a page a query still sees).
        valid = (rows < BLOCK) & (pos <= p) & (pos >= lo) & ((rows * 0 + page) >= 0)  # [BLOCK_B]
        kvmask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = _load_page_f32(k_pages, k_scale, page, h, rows, d, kvmask, num_kv_heads, BLOCK, HEAD_DIM, IS_FP8)
        v = _load_page_f32(v_pages, v_scale, page, h, rows, d, kvmask, num_kv_heads, BLOCK, HEAD_DIM, IS_FP8)
        scores = tl.reduce(qv[:, None, :] * k[None, :, :], 2, _add)  # [BLOCK_R, BLOCK_B]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(scores, 1, _max))
        alpha = tl.exp(m_i - m_new)
        probs = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(probs, 1, _add)
        acc = acc * alpha[:, None] + tl.reduce(probs[:, :, None] * v[None, :, :], 1, _add)
        m_i = m_new
    res = acc / l_i[:, None]
    tl.store(out + s.to(tl.int64) * stride_os + heads[:, None] * stride_oh + d[None, :],
             res.to(out.dtype.element_ty), mask=qmask)


def paged_decode_attention(q, k_pages, v_pages, k_scale, v_scale, block_tables, context_lens,
                           window, sm_scale) -> torch.Tensor:
    """See ``kvwire_kernels.reference.paged_decode_attention``. q: [S, H, D] -> [S, H, D]."""
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block, _ = k_pages.shape
    ratio = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    assert q.stride(-1) == 1
    tables = block_tables.to(torch.int32).contiguous()
    is_fp8 = k_pages.dtype == torch.float8_e4m3fn
    _decode_attn_kernel[(num_seqs, num_kv_heads)](
        q, _int_view(k_pages), _int_view(v_pages), _int_view(k_scale) if is_fp8 else k_pages,
        _int_view(v_scale) if is_fp8 else v_pages, tables, context_lens.to(torch.int32).contiguous(), out,
        float(sm_scale), 0 if window is None else int(window), num_kv_heads, tables.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), RATIO=ratio, BLOCK=block,
        HEAD_DIM=head_dim, BLOCK_R=max(triton.next_power_of_2(ratio), 1),
        BLOCK_B=triton.next_power_of_2(block), BLOCK_D=triton.next_power_of_2(head_dim),
        HAS_WINDOW=window is not None, IS_FP8=is_fp8)
    return out
