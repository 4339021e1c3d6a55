"""KV page kernels: the PyTorch reference against first principles, Triton against the reference.

Triton has no CPU backend; TRITON_INTERPRET=1 runs the kernels on CPU tensors. triton.jit reads
the variable when it decorates a kernel, and ``kernels.triton_kv`` may already have been imported
in this process without it, so this module loads its own interpreted copy of the kernel file
(the kernels avoid triton's own jit helpers such as tl.sum for the same reason: see there).

Tolerances: the kernels round with explicit bit arithmetic (see kernels/triton_kv.py), so writes
and dequantization must match the reference byte for byte; attention only differs in float32
summation order (online softmax), hence rtol = atol = 1e-5.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel below is decorated

import importlib.util  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import kernels  # noqa: E402
from kvwire.kv.dense import attention_mask, sdpa_gqa  # noqa: E402
from kernels import reference as ref  # noqa: E402

_spec = importlib.util.spec_from_file_location("_triton_kv_interpreted",
                                               Path(kernels.__file__).parent / "triton_kv.py")
tkv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tkv)

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
HKV, D = 2, 32


def fp8_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest |dequant(quant(x)) - x|: half an e4m3 step (2**-4 relative), or half the
    subnormal step (2**-10 * scale) near zero."""
    return torch.maximum(x.abs() * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 1e-6)


def empty_pages(num_pages, block, dtype, garbage=False, seed=0):
    shape = (num_pages, HKV, block, D)
    if garbage:  # stale bytes from a previous owner, NaN bit patterns included
        g = torch.Generator().manual_seed(seed)
        k = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        v = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        if dtype == BF16:  # random bf16 bits: pair up bytes
            k, v = k.view(-1).view(torch.int16)[:k.numel() // 2], v.view(-1).view(torch.int16)[:v.numel() // 2]
            k, v = torch.cat([k, k]).view(BF16).view(shape), torch.cat([v, v]).view(BF16).view(shape)
        else:
            k, v = k.view(FP8), v.view(FP8)
    else:
        k, v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    scales = (torch.zeros(num_pages, HKV), torch.zeros(num_pages, HKV)) if dtype == FP8 else (None, None)
    return [k, v, *scales]


def clone(state):
    return [None if t is None else t.clone() for t in state]


def slots_for(table, start, n, block):
    return [table[p // block] * block + p % block for p in range(start, start + n)]


# ---- the reference against first principles ---------------------------------------------------

def test_write_then_dequantize_round_trips_within_fp8_error():
    k, v, ks, vs = empty_pages(4, 16, FP8)
    x = torch.randn(40, HKV, D) * torch.logspace(-3, 1, 40)[:, None, None]  # wide dynamic range
    slots = torch.tensor(slots_for([2, 0, 3], 0, 40, 16))
    ref.write_kv(k, v, ks, vs, x, -x, slots)
    back = ref.dequantize_pages(k, ks, torch.tensor([2, 0, 3])).transpose(1, 2).reshape(48, HKV, D)[:40]
    page_scale = ks[torch.tensor([2, 0, 3])].repeat_interleave(16, 0)[:40, :, None]  # [40, HKV, 1]
    assert ((back - x).abs() <= fp8_bound(x, page_scale)).all()
    torch.testing.assert_close(ks, vs)  # |-x| == |x|
    for blk, page in enumerate([2, 0, 3]):  # scales are exactly amax / 448 per (page, head)
        chunk = x[blk * 16:(blk + 1) * 16]  # [<=16, HKV, D]
        torch.testing.assert_close(ks[page], chunk.abs().amax(dim=(0, 2)) / 448, rtol=0, atol=0)


def test_fp8_to_float_is_torch_cast_for_every_byte():
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    expect = codes.float()
    finite = ~expect.isnan()  # 0x7f / 0xff: never written; the bit trick reads them as +-480
    assert torch.equal(ref.fp8_to_float(codes)[finite], expect[finite])
    assert ref.fp8_to_float(codes).isfinite().all()


def test_scale_growth_requantizes_held_entries():
    k, v, ks, vs = empty_pages(2, 16, FP8)
    small = torch.randn(5, HKV, D) * 0.01
    ref.write_kv(k, v, ks, vs, small, small, torch.arange(16, 21))  # page 1, offsets 0..4
    old_scale, held = ks[1].clone(), ref.dequantize_pages(k, ks, torch.tensor([1]))[0]
    big = torch.randn(1, HKV, D) * 10
    ref.write_kv(k, v, ks, vs, big, big, torch.tensor([21]))
    new_scale = big.abs().amax(dim=(0, 2)) / 448
    torch.testing.assert_close(ks[1], torch.maximum(old_scale, new_scale), rtol=0, atol=0)
    # Held entries: dequantized with the old scale, quantized with the new one.
    expect = ref.quantize_fp8(held, ks[1][:, None, None])
    assert torch.equal(k[1].view(torch.uint8), torch.where(
        torch.arange(16)[None, :, None] == 5, k[1], expect).view(torch.uint8))
    after = ref.dequantize_pages(k, ks, torch.tensor([1]))[0]  # [HKV, 16, D]
    assert ((after[:, :5] - small.transpose(0, 1)).abs()
            <= fp8_bound(small.transpose(0, 1), ks[1][:, None, None]) * 2).all()
    # A smaller token later leaves the scale (and the page) alone.
    before, scale_before = k[1].clone(), ks[1].clone()
    ref.write_kv(k, v, ks, vs, small[:1], small[:1], torch.tensor([22]))  # offset 6
    assert torch.equal(ks[1], scale_before)
    assert torch.equal(before[:, :6].view(torch.uint8), k[1, :, :6].view(torch.uint8))


def test_fresh_page_is_scrubbed_and_zero_tokens_are_finite():
    k, v, ks, vs = empty_pages(2, 16, FP8, garbage=True)
    ks.zero_(), vs.zero_()  # the caller's contract for a freshly allocated page
    zeros = torch.zeros(3, HKV, D)
    ref.write_kv(k, v, ks, vs, zeros, zeros, torch.arange(3))
    assert (ks[0] > 0).all() and torch.equal(ref.dequantize_pages(k, ks, torch.tensor([0])),
                                             torch.zeros(1, HKV, 16, D))


def test_bf16_pages_are_a_plain_cast():
    k, v, ks, vs = empty_pages(3, 16, BF16)
    x = torch.randn(20, HKV, D)
    ref.write_kv(k, v, ks, vs, x, 2 * x, torch.tensor(slots_for([1, 2], 0, 20, 16)))
    got = ref.dequantize_pages(v, None, torch.tensor([1, 2])).transpose(1, 2).reshape(32, HKV, D)[:20]
    assert torch.equal(got, (2 * x).to(BF16).float())


# ---- scenario shared by the Triton comparisons ------------------------------------------------

def build_cache(block, dtype, ctx_lens, window, num_pages=24, seed=0):
    """Pages for len(ctx_lens) sequences written like the engine does: a prefill of all but the
    last two tokens (several sequences in one call), then two one-token decode writes.
    Returns (state, block_tables [S, max_blocks] int32) with released pages as -1 (NaN-filled)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables, i = [], 0
    for n in ctx_lens:
        nb = -(-n // block)
        tables.append(perm[i:i + nb])
        i += nb
    state = empty_pages(num_pages, block, dtype)
    steps = [[(t, 0, n - 2) for t, n in zip(tables, ctx_lens)],
             [(t, n - 2, 1) for t, n in zip(tables, ctx_lens)],
             [(t, n - 1, 1) for t, n in zip(tables, ctx_lens)]]
    for step in steps:
        slots = torch.tensor([s for t, start, n in step for s in slots_for(t, start, n, block)])
        grow = 1.0 + 3.0 * torch.rand(len(slots), 1, 1, generator=g)  # later tokens: bigger scales
        kn = torch.randn(len(slots), HKV, D, generator=g) * grow
        vn = torch.randn(len(slots), HKV, D, generator=g) * grow
        ref.write_kv(*state, kn, vn, slots)
    width = max(len(t) for t in tables)
    bt = torch.full((len(tables), width), -1, dtype=torch.int32)
    for s, (t, n) in enumerate(zip(tables, ctx_lens)):
        bt[s, :len(t)] = torch.tensor(t, dtype=torch.int32)
        if window is not None:  # give back pages wholly before the window, and trash them
            for b in range(max(0, n - window) // block):
                state[0][t[b]] = float("nan")
                state[1][t[b]] = float("nan")
                bt[s, b] = -1
    return state, bt


def independent_attention(q, state, bt, ctx_lens, window, block):
    """Per sequence: dequantize its live pages, build the mask, plain sdpa (no shared code paths
    with the vectorized reference except dequantize_pages)."""
    k, v, ks, vs = state
    outs = []
    for s, n in enumerate(ctx_lens):
        ids = bt[s].long()
        live = [b for b in range(-(-n // block)) if ids[b] >= 0]
        keys = ref.dequantize_pages(k, ks, ids[live]).transpose(1, 2).reshape(-1, HKV, D)
        vals = ref.dequantize_pages(v, vs, ids[live]).transpose(1, 2).reshape(-1, HKV, D)
        kpos = torch.cat([torch.arange(b * block, (b + 1) * block) for b in live])
        keep = kpos < n
        mask = attention_mask(torch.tensor([n - 1]), kpos[keep], window)
        outs.append(sdpa_gqa(q[s:s + 1], keys[keep], vals[keep], mask))
    return torch.cat(outs)


CTX = [37, 16, 70]  # a partly filled last page, an exactly full one, several pages


@pytest.mark.parametrize("dtype", [FP8, BF16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("window", [None, 20])
def test_reference_attention_matches_per_sequence_sdpa(dtype, window):
    state, bt = build_cache(16, dtype, CTX, window)
    q = torch.randn(len(CTX), 4 * HKV, D)
    got = ref.paged_decode_attention(q, *state, bt, torch.tensor(CTX, dtype=torch.int32), window, D ** -0.5)
    torch.testing.assert_close(got, independent_attention(q, state, bt, CTX, window, 16),
                               rtol=1e-5, atol=1e-5)


# ---- Triton (interpreted) against the reference -----------------------------------------------

@pytest.mark.parametrize("dtype", [FP8, BF16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("block", [16, 32])
def test_triton_write_and_dequantize_match_reference_bytes(block, dtype):
    g = torch.Generator().manual_seed(1)
    ours = empty_pages(8, block, dtype, garbage=True, seed=2)
    if dtype == FP8:  # freshly allocated pages: scales reset, bytes left as they were
        ours[2].zero_(), ours[3].zero_()
    theirs = clone(ours)
    tables = [[5, 1, 6], [2, 7]]
    steps = [[(tables[0], 0, block + 3), (tables[1], 0, 5)],  # prefill, two sequences, one call
             [(tables[0], block + 3, 1), (tables[1], 5, 1)],  # decode into partly filled pages
             [(tables[1], 6, block)]]  # a verify-sized run crossing a page boundary
    for i, step in enumerate(steps):
        slots = torch.tensor([s for t, start, n in step for s in slots_for(t, start, n, block)])
        x = torch.randn(len(slots), HKV, D, generator=g) * (1 + 4 * i)  # scales grow each step
        ref.write_kv(*ours, x, -x * 0.5, slots)
        tkv.write_kv(*theirs, x, -x * 0.5, slots)
        for a, b in zip(ours, theirs):
            if a is not None:
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"step {i}"
    ids = torch.tensor([5, 1, 2, 7])  # the written pages (page 6 is still unallocated garbage)
    for pages, scales in ((ours[0], ours[2]), (ours[1], ours[3])):
        torch.testing.assert_close(tkv.dequantize_pages(pages, scales, ids),
                                   ref.dequantize_pages(pages, scales, ids), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [FP8, BF16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("window", [None, 20], ids=["full", "window20"])
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("block", [16, 32])
def test_triton_decode_attention_matches_reference(block, ratio, window, dtype):
    state, bt = build_cache(block, dtype, CTX, window)
    q = torch.randn(len(CTX), ratio * HKV, D)
    ctx = torch.tensor(CTX, dtype=torch.int32)
    expect = ref.paged_decode_attention(q, *state, bt, ctx, window, D ** -0.5)
    got = tkv.paged_decode_attention(q, *state, bt, ctx, window, D ** -0.5)
    assert got.isfinite().all()  # released (NaN) pages were never read
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
