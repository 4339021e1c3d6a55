"""PyTorch references for the KV page kernels: the specification, and the CPU path.

Per layer (format 2, ``KVPageSpec``): pages [num_pages, num_kv_heads, block_size, head_dim] fp8 e4m3
or bf16, scales [num_pages, num_kv_heads, block_size] bf16 (fp8 only), value = fp8 * scale, slot =
``page_id * block_size + offset``. A (token, kv-head) scale is its amax / 448 rounded up to bf16, so
a write never changes bytes already written and the largest value is stored almost exactly (see
docs/decisions/044-cpu-kernel-tuning.md); scale 0 dequantizes to 0. ``triton_kv`` matches these bit
for bit for writes and dequantization, within float32 round-off for attention.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.bfloat16
SCALE_FLOOR = 1e-12  # scales are never 0 after a write, so x / scale is always finite


def token_scale(amax: torch.Tensor) -> torch.Tensor:
    """float32 amax -> float32 scale, exactly a bfloat16: max(amax / 448, floor) rounded up (so
    amax / scale <= 448 and nothing saturates). Bit arithmetic, so Triton gets the same bits."""
    bits = (amax.float() / FP8_MAX).clamp_min_(SCALE_FLOOR).view(torch.int32)
    up = ((bits & 0xFFFF) != 0).to(torch.int32) << 16  # positive: rounding up = away from zero
    return ((bits & -65536) + up).view(torch.float32)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 x / scale (broadcast over x's last dim) -> float8_e4m3fn: saturate to +-448, then
    round to nearest even."""
    return (x / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_to_float(x: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float32, exactly, faster than ``x.float()`` on CPU.

    torch converts fp8 element by element; this moves the bits instead: e4m3's exponent and
    mantissa land in float32's fields (bias 127 instead of 7, so scale by 2**120), and e4m3
    subnormals become float32 subnormals, which the same multiplication makes exact.
    The NaN pattern (never written here) would read as 480.
    """
    b = x.contiguous().view(torch.uint8).to(torch.int32)
    sign = (b & 0x80) << 24
    b &= 0x7F
    b <<= 20
    b |= sign
    out = b.view(torch.float32)
    out *= 2.0 ** 120
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def write_kv(k_pages: torch.Tensor, v_pages: torch.Tensor, k_scale: torch.Tensor | None,
             v_scale: torch.Tensor | None, k_new: torch.Tensor, v_new: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``k_new``/``v_new`` [num_tokens, num_kv_heads, head_dim] into their slots, in place.

    slot_mapping: [num_tokens] int64, distinct slots, in any order (several tokens of one page
    are fine). fp8 pages: each (token, kv-head) gets its own scale (``token_scale`` of its amax)
    and its values are quantized with it; nothing else in the page is read or written.
    K and V go through the arithmetic together (stacked): at batch 1 this runs per layer per
    token, and its cost is the number of torch calls, not their size.
    """
    block_size = k_pages.shape[2]
    page_ids = slot_mapping // block_size  # [num_tokens]
    offsets = slot_mapping % block_size
    if k_scale is None:  # bf16 pages: a plain cast
        # Advanced indices around a slice put the token dim first: [num_tokens, num_kv_heads, head_dim].
        k_pages[page_ids, :, offsets] = k_new.to(k_pages.dtype)
        v_pages[page_ids, :, offsets] = v_new.to(v_pages.dtype)
        return
    new = torch.stack((k_new, v_new)).float()  # [2, num_tokens, num_kv_heads, head_dim]
    scale = token_scale(new.abs().amax(dim=-1))  # [2, num_tokens, num_kv_heads], bf16-exact
    q = quantize_fp8(new, scale).view(torch.uint8)  # [2, num_tokens, num_kv_heads, head_dim]
    k_pages.view(torch.uint8)[page_ids, :, offsets] = q[0]
    v_pages.view(torch.uint8)[page_ids, :, offsets] = q[1]
    s = scale.to(SCALE_DTYPE)  # exact: already a bfloat16 value
    k_scale[page_ids, :, offsets] = s[0]
    v_scale[page_ids, :, offsets] = s[1]


def dequantize_pages(pages: torch.Tensor, scales: torch.Tensor | None,
                     page_ids: torch.Tensor) -> torch.Tensor:
    """pages[page_ids] as float32 [n, num_kv_heads, block_size, head_dim]."""
    if scales is None:
        return pages[page_ids].float()
    out = fp8_to_float(pages.view(torch.uint8)[page_ids].view(FP8_DTYPE))
    out *= scales[page_ids].float()[..., None]
    return out


def paged_decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           window: int | None, sm_scale: float) -> torch.Tensor:
    """One query per row over its sequence's pages. q: [S, H, D] -> [S, H, D] (q's dtype).

    Row s's query sits at position p = context_lens[s] - 1 (its K/V already written) and sees
    keys j with j <= p and, with a window, j > p - window. block_tables: [S, max_blocks] int32;
    entries for pages released behind the window are -1 and never read. Several rows may be
    queries of one sequence (same table, growing context lengths: a speculative verification
    written at once); each row's result is independent of the others', bit for bit.
    Vectorized over sequences (no Python loop): this runs once per layer per decode step.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_pages.shape
    ratio = num_heads // num_kv_heads
    ctx = context_lens.to(torch.int64)  # [S]
    tables = block_tables.to(torch.int64)
    first = 0
    if window is not None:  # skip columns no sequence can see (released pages live there)
        first = max(0, int(ctx.min()) - window) // block_size
    last = -(-int(ctx.max()) // block_size)
    tables = tables[:, first:last]  # [S, nb]
    nb = tables.shape[1]
    ids = tables.clamp_min(0).flatten()  # -1 entries (released pages) are masked and zeroed below

    def gather(pages: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        # Transpose while still 1-2 bytes wide, then widen: [S, Hkv, nb, B, D] float32.
        raw = _bytes(pages)[ids].view(num_seqs, nb, num_kv_heads, block_size, head_dim).transpose(1, 2)
        if scales is None:
            out = raw.contiguous().float()
        else:
            out = fp8_to_float(raw.contiguous().view(FP8_DTYPE))
            sc = scales[ids].view(num_seqs, nb, num_kv_heads, block_size).transpose(1, 2)  # [S, Hkv, nb, B]
            out *= sc.float()[..., None]
        return out.view(num_seqs, num_kv_heads, nb * block_size, head_dim)  # [S, Hkv, L, D]

    k, v = gather(k_pages, k_scale), gather(v_pages, v_scale)
    released = tables < 0  # [S, nb]
    if window is not None and bool(released.any()):
        # Masked scores get weight 0, but 0 * NaN is NaN: don't let a page given back (and maybe
        # reused or overwritten) leak in through its stand-in.
        dead = released.repeat_interleave(block_size, dim=1)[:, None, :, None]  # [S, 1, L, 1]
        k = k.masked_fill(dead, 0.0)
        v = v.masked_fill(dead, 0.0)
    pos = first * block_size + torch.arange(nb * block_size, device=q.device)  # [L]
    p = (ctx - 1)[:, None]  # [S, 1]
    allowed = pos[None, :] <= p  # [S, L]
    if window is not None:
        allowed &= pos[None, :] > p - window
    qg = q.float().view(num_seqs, num_kv_heads, ratio, head_dim)  # [S, Hkv, ratio, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)) * sm_scale  # [S, Hkv, ratio, L]
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1), v)  # [S, Hkv, ratio, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


ACT8_BLOCK = 32  # activation values per int8 scale in linear_i8a8 (llama.cpp's q8_0 block)


def quantize_act8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] fp32 (in % 32 == 0) -> (q [rows, in] int8, s [rows, in / 32] fp32): per block of
    32, s = amax / 127 and q = round-to-nearest-even(x * (127 / amax)); a zero block gives 0s."""
    rows, n = x.shape
    xb = x.float().reshape(rows, n // ACT8_BLOCK, ACT8_BLOCK)
    amax = xb.abs().amax(dim=2)  # [rows, blocks]
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None]).to(torch.int8).reshape(rows, n)
    return q, amax / 127.0


def linear_i8a8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """Int8 weights [out, in] (per-row scale [out]) x int8 activations (``quantize_act8``):
    y[r, o] = scale[o] * sum_b s[r, b] * (q[r, b] . w[o, b]), the dot products exact -> [rows, out]."""
    q, s = quantize_act8(x)
    rows, n = q.shape
    blocks = n // ACT8_BLOCK
    qb = q.reshape(rows, blocks, ACT8_BLOCK).transpose(0, 1).double()  # [blocks, rows, 32]
    wb = w.reshape(-1, blocks, ACT8_BLOCK).transpose(0, 1).double()  # [blocks, out, 32]
    dots = torch.bmm(qb, wb.transpose(1, 2))  # [blocks, rows, out], exact integers in float64
    y = (dots * s.double().T[..., None]).sum(0) * scale.double()  # [rows, out]
    y = y.float()
    return y if bias is None else y + bias



GGUF_BLOCK_SIZES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176),
                    "Q6_K": (256, 210)}  # (values, bytes) per block


def k_scales(packed12: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes [..., 12] -> 6-bit scales and mins [..., 8] (gguf's ``get_scale_min``):
    bytes 0-3 hold scales 0-3 and the top 2 bits of scales 4-7, bytes 4-7 the same for the mins,
    bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    d, m, md = packed12[..., 0:4], packed12[..., 4:8], packed12[..., 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _f16(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.float16).float()


def gguf_blocks(raw: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GGUF rows of blocks, uint8 [out, bytes] -> per sub-block of B values (32; Q6_K 16): q [out, n, B]
    fp32 integers, dq [out, n, 1] fp32, mq [out, n, 1] fp32 or None, value = dq * q (+ mq):
    Q4_0 d, q - 8; Q4_1 d, q, m; Q8_0 d, q; Q4_K / Q5_K d * sc, q, -(dmin * mn) (6-bit scale and min,
    both products exact in fp32); Q6_K d * sc (int8), q - 32. d, m, dmin fp16. Bit layouts: the
    nibbles of Q4_0 / Q4_1 low ones first; K types: 32 bytes hold blocks 2g (low nibbles) and 2g + 1
    of a 64-value group, Q5_K's fifth bit of value 32b + i is bit b of qh[i], Q6_K's nibble of value
    128h + 64s + i is ql[64h + i]'s (s: high) and its 2 high bits those of qh[32h + i % 32] at 2 (i // 32 + 2 s)."""
    values, size = GGUF_BLOCK_SIZES[qtype]
    out = raw.shape[0]
    blocks = raw.reshape(out, -1, size)  # [out, blocks, bytes]
    if qtype == "Q6_K":
        ql = blocks[..., 0:128].reshape(out, -1, 2, 1, 64)
        ql = torch.cat((ql & 0x0F, ql >> 4), dim=3).reshape(out, -1, 256)
        qh = blocks[..., 128:192].reshape(out, -1, 2, 1, 32)
        qh = torch.cat([(qh >> (2 * s)) & 3 for s in range(4)], dim=3).reshape(out, -1, 256)
        q = ((ql | (qh << 4)).to(torch.int8) - 32).float().reshape(out, -1, 16)
        dq = _f16(blocks[..., 208:210]) * blocks[..., 192:208].contiguous().view(torch.int8).float()  # [out, blocks, 16]
        return q, dq.reshape(out, -1, 1), None
    d = _f16(blocks[..., 0:2])  # [out, blocks, 1]
    if qtype == "Q8_0":
        return blocks[..., 2:].contiguous().view(torch.int8).float(), d, None
    if qtype in ("Q4_K", "Q5_K"):
        sc, mn = k_scales(blocks[..., 4:16])  # [out, blocks, 8]
        qs = blocks[..., size - 128:].reshape(out, -1, 4, 1, 32)  # [out, blocks, group, 1, 32]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=3).reshape(out, -1, 8, 32)  # [out, blocks, 8, 32]
        if qtype == "Q5_K":
            qh = blocks[..., 16:48].reshape(out, -1, 1, 32)
            q = q | (torch.cat([(qh >> b) & 1 for b in range(8)], dim=2) << 4)
        dq = (d * sc.float()).reshape(out, -1, 1)
        return q.float().reshape(out, -1, 32), dq, -(_f16(blocks[..., 2:4]) * mn.float()).reshape(out, -1, 1)
    qs = blocks[..., size - 16:]
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # [out, blocks, 32]
    if qtype == "Q4_0":
        return (q.to(torch.int8) - 8).float(), d, None
    return q.float(), d, _f16(blocks[..., 2:4])


def dequantize_gguf(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """GGUF rows of blocks -> fp32 [out, in], the values ``gguf.quants.dequantize`` gives, bit for bit
    (the same fp32 operations: dq * q, then + mq)."""
    q, dq, mq = gguf_blocks(raw, qtype)
    w = dq * q if mq is None else dq * q + mq
    return w.reshape(raw.shape[0], -1)  # [out, in]


def linear_gguf(x: torch.Tensor, raw: torch.Tensor, qtype: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """GGUF weights as stored x int8 activations (``quantize_act8``), the products exact:
    y[r, o] = sum_j s[r, j] * (dq[o, j] * (q[o, j] . a[r, j]) + mq[o, j] * sum(a[r, j])) over the
    weight's sub-blocks j (s: the scale of the activation block holding j) -> [rows, out] fp32."""
    a, s = quantize_act8(x)
    rows, n = a.shape
    q, dq, mq = (None if t is None else t.double() for t in gguf_blocks(raw, qtype))
    per = q.shape[-1]  # values per sub-block: 32, or 16
    s = s.repeat_interleave(ACT8_BLOCK // per, dim=1)  # [rows, sub-blocks]
    ab = a.reshape(rows, n // per, per).transpose(0, 1).double()  # [sub-blocks, rows, per]
    dots = torch.bmm(ab, q.transpose(0, 1).transpose(1, 2))  # [sub-blocks, rows, out], exact integers
    y = (dots * (s.double().T[..., None] * dq[..., 0].T[:, None, :])).sum(0)  # [rows, out]
    if mq is not None:
        y += (s.double() * ab.sum(-1).T) @ mq[..., 0].T
    y = y.float()
    return y if bias is None else y + bias
