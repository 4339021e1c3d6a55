"""PyTorch references for the KV page kernels: the specification, and the CPU path.

Page layout (see ``kvwire.kv.spec.KVPageSpec``), per layer:

    k_pages, v_pages  [num_pages, num_kv_heads, block_size, head_dim]  float8_e4m3fn or bfloat16
    k_scale, v_scale  [num_pages, num_kv_heads] float32 (fp8 only; None for bf16 pages)

    value = float(fp8) * scale[page, kv_head]

A token's slot is ``page_id * block_size + offset``. Scales only ever grow: when new tokens need a
larger scale, the entries already in that (page, kv-head) are requantized to it, so a page stays
one scale group without the writer knowing the page's history. A freshly allocated page must have
its scales reset to 0 by the caller (0 means "empty": no entry is worth keeping).

``kernels.triton_kv`` implements the same three functions and is tested bit-for-bit against these
(for writes) and within float32 round-off (for attention).
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_FLOOR = 1e-12  # scales are never 0 after a write, so x / scale is always finite
FP8_DTYPE = torch.float8_e4m3fn


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 x / scale -> float8_e4m3fn: saturate to +-448, then round to nearest even."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_to_float(x: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float32, exactly, about 4x faster than ``x.float()`` on CPU.

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


def _to_float(pages: torch.Tensor) -> torch.Tensor:
    return fp8_to_float(pages) if pages.dtype == FP8_DTYPE else pages.float()


def write_kv(k_pages: torch.Tensor, v_pages: torch.Tensor, k_scale: torch.Tensor | None,
             v_scale: torch.Tensor | None, k_new: torch.Tensor, v_new: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``k_new``/``v_new`` [num_tokens, num_kv_heads, head_dim] into their slots, in place.

    slot_mapping: [num_tokens] int64, distinct slots. fp8 pages: each touched (page, kv-head)
    scale becomes max(old, amax(new tokens there) / 448, floor); if it grew, the page's existing
    entries are requantized to it; then the new tokens are quantized with it.
    K and V go through the scale arithmetic together (stacked): at batch 1 this runs per layer
    per token, and its cost is the number of torch calls, not their size.
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
    tok_amax = new.abs().amax(dim=-1)  # [2, num_tokens, num_kv_heads]
    if page_ids.numel() == 1:  # batch-1 decode: no torch.unique / scatter needed
        uniq, inverse, page_amax = page_ids, None, tok_amax
    else:
        uniq, inverse = torch.unique(page_ids, return_inverse=True)  # [num_touched]
        page_amax = tok_amax.new_zeros(2, uniq.numel(), tok_amax.shape[2]).scatter_reduce_(
            1, inverse[None, :, None].expand_as(tok_amax), tok_amax, "amax")  # [2, num_touched, Hkv]
    old = torch.stack((k_scale[uniq], v_scale[uniq]))  # [2, num_touched, num_kv_heads]
    new_scale = torch.maximum(old, page_amax / FP8_MAX).clamp_min(SCALE_FLOOR)
    grew = new_scale > old
    if bool(grew.any()):
        for i, (pages, scales) in enumerate(((k_pages, k_scale), (v_pages, v_scale))):
            # Requantize what the page holds: dequantize with the old scale, quantize with the
            # new one. A fresh page (old scale 0) becomes +0 bytes whatever a previous owner left,
            # so a page's bytes depend on its sequence alone (wire checksums are reproducible).
            held = pages[uniq]  # [num_touched, num_kv_heads, B, D]
            values = fp8_to_float(held) * old[i, :, :, None, None]
            values.masked_fill_((old[i] == 0)[:, :, None, None], 0.0)  # not -0.0 from 0 * negative
            requant = quantize_fp8(values, new_scale[i, :, :, None, None])
            pages[uniq] = torch.where(grew[i, :, :, None, None], requant, held)
            scales[uniq] = new_scale[i]
    tok_scale = new_scale if inverse is None else new_scale[:, inverse]  # [2, num_tokens, Hkv]
    q = quantize_fp8(new, tok_scale[..., None])  # [2, num_tokens, num_kv_heads, head_dim]
    k_pages[page_ids, :, offsets] = q[0]
    v_pages[page_ids, :, offsets] = q[1]


def dequantize_pages(pages: torch.Tensor, scales: torch.Tensor | None,
                     page_ids: torch.Tensor) -> torch.Tensor:
    """pages[page_ids] as float32 [n, num_kv_heads, block_size, head_dim]."""
    out = _to_float(pages[page_ids])
    if scales is not None:
        out *= scales[page_ids][:, :, None, None]
    return out


def paged_decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           window: int | None, sm_scale: float) -> torch.Tensor:
    """One query per sequence over its pages. q: [S, H, D] -> [S, H, D] (q's dtype).

    Sequence s's query sits at position p = context_lens[s] - 1 (its K/V already written) and
    sees keys j with j <= p and, with a window, j > p - window. block_tables: [S, max_blocks]
    int32; entries for pages released behind the window are -1 and never read.
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
        raw = pages[ids].view(num_seqs, nb, num_kv_heads, block_size, head_dim).transpose(1, 2)
        out = _to_float(raw.contiguous())
        if scales is not None:
            out *= scales[ids].view(num_seqs, nb, num_kv_heads).transpose(1, 2)[..., None, None]
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
