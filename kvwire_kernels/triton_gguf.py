"""Triton kernels on GGUF blocks as the file stores them (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K): W4A16.

The spec is ``kvwire_kernels.reference.gguf_blocks``: per sub-block j of 32 values (Q6_K: 16) a
weight row holds small integers q (|q| <= 128), a scale dq and, for Q4_1 / Q4_K / Q5_K, an offset mq
(value = dq * q + mq, fp32, exactly gguf's). The weight stays in its blocks in GPU memory, uint8
[out, blocks * bytes], the rows of blocks as stored (no repacking: a row's blocks are contiguous, so
a tile reads a run of whole blocks per row); each tile's bytes are unpacked in registers.

``linear``: y = x @ dequant(W)^T with activations in 16 bits (fp16 or bf16 as given; fp32 is
rounded to bf16 first, in torch, which rounds to nearest even) and fp32 accumulation. The dot
multiplies each sub-block's integers q, exact in fp16 and bf16, and its fp32 scale applies to the
fp32 partial after the dot (mq to the sub-block's fp32 sum of x): no bit of the weight is rounded
away, so y is sum_k x16[k] * w[k] up to fp32 summation order. (Dequantizing first to fp16 would not
be exact: an fp16 d times a 4-bit q needs up to 14 significant bits, fp16 holds 11; bf16 holds 8.)
Decode-sized batches also split the inputs across programs (``splits``). Tiles and splits are
untuned: these kernels have been run under the interpreter and compiled for sm_90, not yet timed.
``dequantize``: the fp32 weight, ``reference.dequantize_gguf``'s bits (dq * q is exact in fp32, so
fused or not, dq * q + mq rounds once).
Preconditions: raw contiguous uint8, in_features a whole number of blocks.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvwire_kernels.reference import GGUF_BLOCK_SIZES

# A row sum is tl.reduce over this module's own combine function, not tl.sum (nor triton's
# _sum_combine): those are decorated when triton is first imported, and this file's kernels must
# compile whether that import happened under TRITON_INTERPRET=1 or not (see triton_kv.py).
@triton.jit
def _add(a, b):
    return a + b


FORMATS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5}
SUB_BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 32, "Q5_K": 32, "Q6_K": 16}  # values per scale
HAS_MIN = ("Q4_1", "Q4_K", "Q5_K")


@triton.jit
def _byte(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(p, mask):
    """The little-endian fp16 at byte pointers ``p`` -> fp32 (exact)."""
    bits = _byte(p, mask) | (_byte(p + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _sub_block(row, nmask, j, i, FMT: tl.constexpr):
    """Sub-block ``j`` of the rows whose bytes start at ``row`` [BN] (uint8 pointers):
    q [SUB, BN] int32 (value i of the sub-block down, rows across), dq [BN] fp32, mq [BN] fp32 (0 where
    the format has none). ``i``: arange(0, SUB). The bit layouts: ``reference.gguf_blocks``."""
    qmask = nmask[None, :]
    zero = nmask.to(tl.float32) * 0.0
    if FMT == 0:  # Q4_0: d, 16 bytes of nibbles (value i: byte i % 16, high nibble from 16 on)
        base = row + j * 18
        b = _byte(base[None, :] + (2 + i % 16)[:, None], qmask)
        q = ((b >> ((i // 16) * 4)[:, None]) & 15) - 8
        dq = _f16(base, nmask)
        mq = zero
    elif FMT == 1:  # Q4_1: d, m, nibbles
        base = row + j * 20
        b = _byte(base[None, :] + (4 + i % 16)[:, None], qmask)
        q = (b >> ((i // 16) * 4)[:, None]) & 15
        dq = _f16(base, nmask)
        mq = _f16(base + 2, nmask)
    elif FMT == 2:  # Q8_0: d, 32 int8
        base = row + j * 34
        b = _byte(base[None, :] + (2 + i)[:, None], qmask)
        q = b - ((b >> 7) << 8)  # int8
        dq = _f16(base, nmask)
        mq = zero
    elif FMT == 5:  # Q6_K: ql 128, qh 64, 16 int8 scales, d; sub-blocks of 16
        t = j % 16
        base = row + (j // 16) * 210
        v = t * 16 + i  # value within the super-block: 128 h + r
        h = v // 128
        r = v % 128
        lo = _byte(base[None, :] + (64 * h + r % 64)[:, None], qmask)
        hi = _byte(base[None, :] + (128 + 32 * h + r % 32)[:, None], qmask)
        q = (((lo >> (4 * (r // 64))[:, None]) & 15) | (((hi >> (2 * (r // 32))[:, None]) & 3) << 4)) - 32
        sc = _byte(base + 192 + t, nmask)
        dq = _f16(base + 208, nmask) * (sc - ((sc >> 7) << 8)).to(tl.float32)
        mq = zero
    else:  # Q4_K (144 bytes) / Q5_K (176): d, dmin, 12 bytes of 6-bit scales and mins, [Q5_K: qh 32], qs 128
        t = j % 8
        base = row + (j // 8) * (144 + 32 * (FMT - 3))
        u = t % 4
        s_lo = _byte(base + 4 + u, nmask)  # scale t (t < 4), or the top 2 bits of scale t (t >= 4)
        m_lo = _byte(base + 8 + u, nmask)
        md = _byte(base + 12 + u, nmask)
        first = (nmask.to(tl.int32) * 0 + t) < 4  # a vector: the interpreter wants no scalar conditions
        sc = tl.where(first, s_lo & 63, (md & 15) | ((s_lo >> 2) & 48))
        mn = tl.where(first, m_lo & 63, (md >> 4) | ((m_lo >> 2) & 48))
        qs = 16 + 32 * (FMT - 3)  # Q4_K 16, Q5_K 48
        b = _byte(base[None, :] + (qs + 32 * (t // 2) + i)[:, None], qmask)
        q = (b >> (4 * (t % 2))) & 15
        if FMT == 4:
            qh = _byte(base[None, :] + (16 + i)[:, None], qmask)
            q = q | (((qh >> t) & 1) << 4)
        dq = _f16(base, nmask) * sc.to(tl.float32)
        mq = -(_f16(base + 2, nmask) * mn.to(tl.float32))
    return q, dq, mq


@triton.jit
def _linear_kernel(x, w, bias, y, M, N, split_len, row_bytes, stride_xm, stride_ys, stride_ym,
                   FMT: tl.constexpr, SUB: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program per [BLOCK_M rows, BLOCK_N outputs] tile and split of the inputs (``split_len``
    # sub-blocks, the splits' partials summed by the caller), over its sub-blocks in order: a row's
    # result never depends on the other rows of its tile (each output sums in one fixed order).
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    i = tl.arange(0, SUB)
    mmask = rm < M
    nmask = rn < N
    row = w + rn.to(tl.int64) * row_bytes  # [BN] each output row's first byte
    xrow = x + rm.to(tl.int64)[:, None] * stride_xm + i[None, :]  # [BM, SUB]
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    first = pid_s * split_len
    for jj in range(0, split_len):
        j = first + jj
        xs = tl.load(xrow + j * SUB, mask=mmask[:, None], other=0.0)  # [BM, SUB] fp16 / bf16
        q, dq, mq = _sub_block(row, nmask, j, i, FMT)
        # q -> fp32 -> 16 bits: exact (|q| <= 128); the interpreter casts int -> bf16 bit by bit
        acc += tl.dot(xs, q.to(tl.float32).to(xs.dtype), out_dtype=tl.float32) * dq[None, :]
        if HAS_MIN:
            acc += tl.reduce(xs.to(tl.float32), 1, _add)[:, None] * mq[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=nmask, other=0.0)[None, :]
    dst = y + pid_s.to(tl.int64) * stride_ys + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(dst, acc.to(y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _dequant_kernel(w, out, N, n_sub, row_bytes, FMT: tl.constexpr, SUB: tl.constexpr, HAS_MIN: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.program_id(1)
    i = tl.arange(0, SUB)
    nmask = rn < N
    q, dq, mq = _sub_block(w + rn.to(tl.int64) * row_bytes, nmask, j, i, FMT)
    vals = dq[None, :] * q.to(tl.float32)  # [SUB, BN]
    if HAS_MIN:  # only then: + 0.0 would turn the reference's -0.0 into +0.0
        vals += mq[None, :]
    dst = out + rn.to(tl.int64)[None, :] * (n_sub * SUB) + (j * SUB + i)[:, None]
    tl.store(dst, vals, mask=nmask[None, :])


def _shape(raw: torch.Tensor, qtype: str) -> tuple[int, int, int]:
    """(out, sub-blocks per row, values per sub-block) of ``raw`` uint8 [out, blocks * bytes]."""
    values, size = GGUF_BLOCK_SIZES[qtype]
    assert raw.dtype == torch.uint8 and raw.is_contiguous() and raw.shape[1] % size == 0
    sub = SUB_BLOCK[qtype]
    return raw.shape[0], raw.shape[1] // size * (values // sub), sub


def dequantize(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """See ``reference.dequantize_gguf``: raw uint8 [out, bytes] -> fp32 [out, in], the same bits."""
    out, n_sub, sub = _shape(raw, qtype)
    w = torch.empty(out, n_sub * sub, dtype=torch.float32, device=raw.device)
    if out and n_sub:
        block_n = 32
        _dequant_kernel[(triton.cdiv(out, block_n), n_sub)](raw, w, out, n_sub, raw.shape[1], FMT=FORMATS[qtype],
                                                            SUB=sub, HAS_MIN=qtype in HAS_MIN, BLOCK_N=block_n)
    return w


def tiles(rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for ``rows`` activation rows. Untuned: not yet timed on a GPU."""
    if rows <= 16:
        return 16, 32, 4
    if rows <= 64:
        return 64, 64, 4
    return 128, 64, 8


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def splits(rows: int, out: int, n_sub: int, sms: int) -> int:
    """How many parts the inputs are split into: 1, except for decode-sized batches (up to 16 rows:
    one tile shape) whose tiles alone would leave most of ``sms`` streaming multiprocessors idle.
    About two programs per SM, each over at least 8 sub-blocks; a divisor of n_sub, so the splits
    are equal. A function of the weight's shape and the device only: a row's bits do not depend on
    its batch."""
    if rows > 16 or sms == 0:
        return 1
    want = triton.cdiv(2 * sms, triton.cdiv(out, tiles(rows)[1]))
    return max(s for s in range(1, max(1, min(want, n_sub // 8)) + 1) if n_sub % s == 0)


def linear(x: torch.Tensor, raw: torch.Tensor, qtype: str, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, split: int | None = None) -> torch.Tensor:
    """x [rows, in] (fp16 / bf16; fp32 is rounded to bf16) @ dequant(raw)^T (+ bias, fp32 [out]) ->
    [rows, out] in ``out_dtype`` (default x's dtype), accumulated in fp32. See the module docstring.
    ``split``: the inputs in that many equal parts (a divisor of the sub-blocks per row), one program
    each, their fp32 partials summed by torch after (default ``splits``)."""
    out, n_sub, sub = _shape(raw, qtype)
    rows, n_in = x.shape
    if n_in != n_sub * sub:
        raise ValueError(f"linear: x has {n_in} inputs, the {qtype} weight {n_sub * sub}")
    split = splits(rows, out, n_sub, _sm_count(x.device)) if split is None else split
    if split < 1 or n_sub % split:
        raise ValueError(f"linear: split {split} does not divide {n_sub} sub-blocks")
    xh = (x if x.dtype in (torch.float16, torch.bfloat16) else x.to(torch.bfloat16)).contiguous()
    y = torch.empty(rows, out, dtype=out_dtype or x.dtype, device=x.device)
    if rows == 0 or out == 0:
        return y
    block_m, block_n, warps = tiles(rows)
    if bias is not None:
        bias = bias.float().contiguous()
    # split > 1: fp32 partials [split, rows, out], summed and biased by torch (no atomics: the same bits every run)
    dst = y if split == 1 else torch.empty(split, rows, out, dtype=torch.float32, device=x.device)
    _linear_kernel[(triton.cdiv(out, block_n), triton.cdiv(rows, block_m), split)](
        xh, raw, xh if bias is None or split > 1 else bias, dst, rows, out, n_sub // split, raw.shape[1], xh.stride(0),
        dst.stride(0) if split > 1 else 0, dst.stride(-2), FMT=FORMATS[qtype], SUB=sub, HAS_MIN=qtype in HAS_MIN,
        HAS_BIAS=bias is not None and split == 1, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    if split > 1:
        acc = dst.sum(0)
        y.copy_(acc if bias is None else acc + bias)
    return y
