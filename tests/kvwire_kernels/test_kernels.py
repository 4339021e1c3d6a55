"""KV page kernels: the PyTorch reference against first principles, Triton against the reference.

TRITON_INTERPRET=1 runs the kernels on CPU tensors; triton.jit reads it when decorating, so this
module loads its own interpreted copy of the kernel file (and a compiled copy, the ``backend``
fixture, where a CUDA device is present; elsewhere those cases skip). Writes and dequantization
must match the reference byte for byte (explicit bit arithmetic); attention differs only in float32
summation order and the GPU's exp, hence rtol = atol = 1e-5.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

import kvwire_kernels
from kvwire.kv.dense import attention_mask, sdpa_gqa
from kvwire_kernels import reference as ref

CUDA = torch.cuda.is_available()


def load_kernels(name: str):
    """A fresh copy of kvwire_kernels/triton_kv.py: its kernels are decorated as TRITON_INTERPRET says now."""
    spec = importlib.util.spec_from_file_location(name, Path(kvwire_kernels.__file__).parent / "triton_kv.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


if CUDA:  # compiled, so first: triton's own modules must not be imported under the variable for that
    os.environ.pop("TRITON_INTERPRET", None)
    import triton  # noqa: F401
    tkv_cuda = load_kernels("_triton_kv_compiled")
_before = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
tkv = load_kernels("_triton_kv_interpreted")
# Unset again, and set only while an interpreted test runs (the fixtures below; triton reads it
# at launch too): pytest imports every test module before it runs any test, and a variable left
# set would make the engine's own lazy import of the kernels interpreted as well (on a GPU,
# tests/engine/test_cuda.py would then run interpreted kernels on CUDA tensors).
if _before is None:
    del os.environ["TRITON_INTERPRET"]


_ON_CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA device"))


def kernels(name: str):
    """(kernel module, device) for the reference, the interpreted Triton kernels on CPU tensors,
    or the compiled ones on CUDA."""
    return {"reference": (ref, "cpu"), "interpreted": (tkv, "cpu"), "cuda": (globals().get("tkv_cuda"), "cuda")}[name]


@pytest.fixture(params=["interpreted", _ON_CUDA])
def backend(request, monkeypatch):
    """A Triton backend: (kernel module, device)."""
    if request.param == "interpreted":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return kernels(request.param)


@pytest.fixture(params=["reference", "interpreted", _ON_CUDA])
def impl(request, monkeypatch):
    """The reference or a Triton backend: (kernel module, device)."""
    if request.param == "interpreted":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return kernels(request.param)


def on(state, dev):
    return [None if t is None else t.to(dev) for t in state]


def back(state):
    return [None if t is None else t.cpu() for t in state]


FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
HKV, D = 2, 32


def fp8_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest |dequant(quant(x)) - x|: half an e4m3 step (2**-4 relative), or half the
    subnormal step (2**-10 * scale) near zero."""
    return torch.maximum(x.abs() * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 1e-6)


def empty_pages(num_pages, block, dtype, garbage=False, seed=0):
    shape = (num_pages, HKV, block, D)
    g = torch.Generator().manual_seed(seed)
    if garbage:  # stale bytes from a previous owner, NaN bit patterns included
        k = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        v = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        if dtype == BF16:  # random bf16 bits: pair up bytes
            k, v = k.view(-1).view(torch.int16)[:k.numel() // 2], v.view(-1).view(torch.int16)[:v.numel() // 2]
            k, v = torch.cat([k, k]).view(BF16).view(shape), torch.cat([v, v]).view(BF16).view(shape)
        else:
            k, v = k.view(FP8), v.view(FP8)
    else:
        k, v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    if dtype != FP8:
        return [k, v, None, None]
    sshape = (num_pages, HKV, block)
    if garbage:  # random bf16 bit patterns (NaN and inf included)
        ks = torch.randint(-32768, 32768, sshape, dtype=torch.int16, generator=g).view(BF16)
        return [k, v, ks, torch.randint(-32768, 32768, sshape, dtype=torch.int16, generator=g).view(BF16)]
    return [k, v, torch.zeros(sshape, dtype=BF16), torch.zeros(sshape, dtype=BF16)]


def raw(state) -> list[torch.Tensor]:
    """Bits of pages [P, HKV, B, D(*2)] and scales [P, HKV, B] (int16: one element per slot)."""
    return [t.view(torch.uint8 if t.dim() == 4 else torch.int16).clone() for t in state if t is not None]


def slots_for(table, start, n, block):
    return [table[p // block] * block + p % block for p in range(start, start + n)]


def bf16_scale(amax: torch.Tensor) -> torch.Tensor:
    """First principles, in float64: the smallest bfloat16 s >= amax / 448 (float32 division)."""
    want = amax.float() / 448
    near = want.to(BF16)  # the nearest bf16; if it is below, the next one up (positive: bits + 1)
    up = (near.view(torch.int16) + 1).view(BF16)
    return torch.where(near.float() >= want, near.float(), up.float())


# ---- the reference against first principles ---------------------------------------------------

def test_write_then_dequantize_round_trips_within_fp8_error():
    k, v, ks, vs = empty_pages(4, 16, FP8)
    x = torch.randn(40, HKV, D) * torch.logspace(-3, 1, 40)[:, None, None]  # wide dynamic range
    slots = torch.tensor(slots_for([2, 0, 3], 0, 40, 16))
    ref.write_kv(k, v, ks, vs, x, -x, slots)
    back = ref.dequantize_pages(k, ks, torch.tensor([2, 0, 3])).transpose(1, 2).reshape(48, HKV, D)[:40]
    amax = x.abs().amax(dim=-1)  # [40, HKV]: one scale per (token, head)
    scale = ks[torch.tensor([2, 0, 3])].transpose(1, 2).reshape(48, HKV)[:40].float()
    assert ((back - x).abs() <= fp8_bound(x, scale[..., None])).all()
    assert torch.equal(ks, vs)  # |-x| == |x|
    ratio = amax / scale  # the largest value lands just under 448: never clipped, stored almost exactly
    assert (ratio <= 448).all() and (ratio > 448 / (1 + 2 ** -7)).all()
    peak = back.abs().amax(dim=-1)
    assert ((peak - amax).abs() <= amax * 2 ** -7).all()


def test_token_scale_is_the_smallest_bf16_that_fits():
    edges = torch.tensor([448.0, 448.0 * 2 ** -20, 448.0 * 2 ** 5, 224.0, 1.0, 1.75, 1.7500001])
    amax = torch.cat([edges, torch.nextafter(edges, torch.tensor(0.0)), torch.nextafter(edges, torch.tensor(1e9)),
                      torch.rand(1000).mul(40).sub(30).exp2()])
    s = ref.token_scale(amax)
    assert torch.equal(s.to(BF16).float(), s)  # exactly representable: storing it loses nothing
    assert torch.equal(s, bf16_scale(amax))
    assert (amax / s <= 448).all()
    assert ref.token_scale(torch.zeros(1)).item() > 0  # an all-zero token: finite, zero values


def test_fp8_to_float_is_torch_cast_for_every_byte():
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    expect = codes.float()
    finite = ~expect.isnan()  # 0x7f / 0xff: never written; the bit trick reads them as +-480
    assert torch.equal(ref.fp8_to_float(codes)[finite], expect[finite])
    assert ref.fp8_to_float(codes).isfinite().all()


def test_pages_are_append_only(impl):
    """Writing token t+1 leaves every byte written before identical, scales included, even when
    the new token is 1000x larger (format 1 grew the page's scale and requantized the page)."""
    mod, dev = impl
    state = on(empty_pages(2, 16, FP8), dev)
    g = torch.Generator().manual_seed(3)
    for t in range(16):
        before = raw(back(state))
        x = (torch.randn(1, HKV, D, generator=g) * 10.0 ** (t % 4 - 1)).to(dev)
        mod.write_kv(*state, x, x * 3, torch.tensor([16 + t], device=dev))  # page 1, offset t
        for b, a in zip(before, raw(back(state))):
            changed = (b != a).any(-1) if b.dim() == 4 else b != a  # [pages, HKV, block]
            assert not changed[0].any() and not changed[1, :, :t].any() and not changed[1, :, t + 1:].any()


def test_one_call_writes_the_bytes_of_one_token_at_a_time():
    """Several tokens of a page in one call (speculative verification), in any slot order."""
    x = torch.randn(20, HKV, D) * torch.logspace(-2, 2, 20)[:, None, None]
    slots = torch.tensor(slots_for([1, 3], 5, 20, 16))
    batched, single = empty_pages(4, 16, FP8), empty_pages(4, 16, FP8)
    perm = torch.randperm(20)
    ref.write_kv(*batched, x[perm], -x[perm], slots[perm])
    for i in range(20):
        ref.write_kv(*single, x[i:i + 1], -x[i:i + 1], slots[i:i + 1])
    assert all(torch.equal(a, b) for a, b in zip(raw(batched), raw(single)))


def test_zero_tokens_are_finite_zeros():
    k, v, ks, vs = empty_pages(2, 16, FP8)
    zeros = torch.zeros(3, HKV, D)
    ref.write_kv(k, v, ks, vs, zeros, zeros, torch.arange(3))
    assert (ks[0, :, :3] > 0).all() and (ks[0, :, 3:] == 0).all()
    assert torch.equal(ref.dequantize_pages(k, ks, torch.tensor([0])), torch.zeros(1, HKV, 16, D))


def test_bf16_pages_are_a_plain_cast():
    k, v, ks, vs = empty_pages(3, 16, BF16)
    x = torch.randn(20, HKV, D)
    ref.write_kv(k, v, ks, vs, x, 2 * x, torch.tensor(slots_for([1, 2], 0, 20, 16)))
    got = ref.dequantize_pages(v, None, torch.tensor([1, 2])).transpose(1, 2).reshape(32, HKV, D)[:20]
    assert torch.equal(got, (2 * x).to(BF16).float())


# ---- scenario shared by the Triton comparisons ------------------------------------------------

def build_cache(block, dtype, ctx_lens, window, num_pages=24, seed=0):
    """Pages for len(ctx_lens) sequences written like the engine does: a prefill of all but the
    last two tokens (several sequences in one call), then two one-token decode writes, tokens of
    widely different magnitudes.
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
        grow = torch.rand(len(slots), 1, 1, generator=g).mul(4).sub(2).exp2()  # 2**-2 .. 2**2
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
def test_triton_write_and_dequantize_match_reference_bytes(block, dtype, backend):
    tk, dev = backend
    g = torch.Generator().manual_seed(1)
    ours = empty_pages(8, block, dtype, garbage=True, seed=2)  # stale bytes: a write must not read them
    theirs = on(ours, dev)
    tables = [[5, 1, 6], [2, 7]]
    steps = [[(tables[0], 0, block + 3), (tables[1], 0, 5)],  # prefill, two sequences, one call
             [(tables[0], block + 3, 1), (tables[1], 5, 1)],  # decode into partly filled pages
             [(tables[1], 6, block)]]  # a verify-sized run crossing a page boundary
    for i, step in enumerate(steps):
        slots = torch.tensor([s for t, start, n in step for s in slots_for(t, start, n, block)])
        x = torch.randn(len(slots), HKV, D, generator=g) * torch.rand(len(slots), 1, 1, generator=g).mul(40).sub(20).exp2()
        if i == 0:  # edge cases: all zero, exact powers of two / scale boundaries, e4m3 ties, subnormals
            x[0] = 0.0
            x[1, :, :4] = torch.tensor([448.0, -448.0, 1.75, 2.0 ** -9])
            x[2] = torch.arange(D).float() * 2.0 ** -10 + 2.0 ** -7  # tiny next to the token's max
            x[3, :, 0] = 448.0 * 1.0000001
            x[4] = torch.tensor([1.0 + 2 ** -4, 1.0 + 3 * 2 ** -4, 2 ** -7 + 2 ** -10, 3.0]).repeat(D // 4)
        ref.write_kv(*ours, x, -x * 0.5, slots)
        tk.write_kv(*theirs, x.to(dev), (-x * 0.5).to(dev), slots.to(dev))
        for a, b in zip(raw(ours), raw(back(theirs))):
            assert torch.equal(a, b), f"step {i}"
    ids = torch.tensor([5, 1, 6, 2, 7])  # page 6: written, plus stale bytes past the written slots
    for pages, scales in ((ours[0], ours[2]), (ours[1], ours[3])):
        got = tk.dequantize_pages(*on([pages, scales], dev), ids.to(dev)).cpu()
        torch.testing.assert_close(got, ref.dequantize_pages(pages, scales, ids), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [FP8, BF16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("window", [None, 20], ids=["full", "window20"])
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("block", [16, 32])
def test_triton_decode_attention_matches_reference(block, ratio, window, dtype, backend):
    tk, dev = backend
    state, bt = build_cache(block, dtype, CTX, window)
    q = torch.randn(len(CTX), ratio * HKV, D)
    ctx = torch.tensor(CTX, dtype=torch.int32)
    expect = ref.paged_decode_attention(q, *state, bt, ctx, window, D ** -0.5)
    got = tk.paged_decode_attention(*on([q, *state, bt, ctx], dev), window, D ** -0.5).cpu()
    assert got.isfinite().all()  # released (NaN) pages were never read
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 20], ids=["full", "window20"])
def test_one_row_per_query_is_bitwise_the_one_token_call(impl, window):
    """How a speculative verification attends in one call: each of a sequence's k+1 queries is
    a row with the sequence's block table and its own context length. Every row must give
    exactly (bit for bit) what a one-token decode at that position gives, tables cut to the
    pages it has then."""
    mod, dev = impl
    state, bt = build_cache(16, FP8, [70], window)
    state, bt = on(state, dev), bt.to(dev)
    n = 6  # positions 64..69 (the last page, partly filled, and the one before)
    q = torch.randn(n, 4 * HKV, D, device=dev)
    ctx = torch.arange(65, 71, dtype=torch.int32, device=dev)
    together = mod.paged_decode_attention(q, *state, bt.repeat(n, 1), ctx, window, D ** -0.5)
    for i in range(n):
        alone = mod.paged_decode_attention(q[i:i + 1], *state, bt[:, :-(-int(ctx[i]) // 16)], ctx[i:i + 1],
                                           window, D ** -0.5)
        assert torch.equal(together[i:i + 1], alone), i


def e4m3_boundaries() -> torch.Tensor:
    """Every finite e4m3 magnitude up to 448, each midpoint between neighbours (a tie) and the
    floats just either side of both, with both signs."""
    vals = torch.arange(128, dtype=torch.uint8).view(FP8).float()
    vals = vals[vals.isfinite()].unique()  # sorted: 0 .. 448
    mids = (vals[1:] + vals[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(0.0)
    pts = torch.cat([vals, mids] + [torch.nextafter(t, d) for t in (vals, mids) for d in (up, down)])
    pts = pts[pts <= 448.0]
    return torch.cat([pts, -pts])


@pytest.mark.parametrize("dtype", [FP8, BF16], ids=["fp8", "bf16"])
def test_every_rounding_boundary_gives_the_references_bytes(dtype, backend):
    """Each token's first value is 448, so its fp8 scale is exactly 1 and every other value is
    rounded as it is: ties, the floats beside them, subnormals, the largest value."""
    tk, dev = backend
    pts = e4m3_boundaries()
    n = -(-len(pts) // (D - 1))
    x = torch.zeros(n * (D - 1))
    x[:len(pts)] = pts
    x = torch.cat([torch.full((n, 1), 448.0), x.view(n, D - 1)], dim=1)[:, None, :].repeat(1, HKV, 1)  # [n, HKV, D]
    pages = -(-n // 16)
    ours = empty_pages(pages, 16, dtype, garbage=True, seed=5)
    theirs = on(ours, dev)
    slots = torch.arange(n)
    ref.write_kv(*ours, x, x * 2 ** -7, slots)
    tk.write_kv(*theirs, x.to(dev), (x * 2 ** -7).to(dev), slots.to(dev))
    for a, b in zip(raw(ours), raw(back(theirs))):
        assert torch.equal(a, b)
    if dtype == FP8:  # and the reference is torch's own cast (round to nearest even, saturating)
        stored = ours[0].transpose(1, 2).reshape(-1, HKV, D)[:n]  # [n, HKV, D] in slot order
        assert torch.equal(stored.view(torch.uint8), x.to(FP8).view(torch.uint8))


def random_pages(num_pages, hkv, block, d, dtype, g):
    """Pages of random contents without NaN patterns (the kernels' reading, not writing, is tested)."""
    shape = (num_pages, hkv, block, d)
    if dtype == BF16:
        return [torch.randn(shape, generator=g).to(BF16), torch.randn(shape, generator=g).to(BF16), None, None]
    bytes_ = [torch.randint(0, 254, shape, dtype=torch.uint8, generator=g) for _ in range(2)]
    bytes_ = [torch.where((b & 0x7F) == 0x7F, b - 1, b) for b in bytes_]  # 0x7f / 0xff are NaN
    scales = [torch.rand(shape[:3], generator=g).mul(3).sub(9).exp2().to(BF16) for _ in range(2)]  # 2**-9 .. 2**-6: |values| < 7, as amax / 448 gives
    return [bytes_[0].view(FP8), bytes_[1].view(FP8), *scales]


@pytest.mark.skipif(not CUDA, reason="no CUDA device")
@pytest.mark.parametrize("dtype", [FP8, BF16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("window", [None, 300], ids=["full", "window300"])
@pytest.mark.parametrize("hkv,ratio,d", [(3, 3, 64), (4, 8, 64), (8, 4, 128)], ids=["smollm2", "tinyllama", "llama3-8b"])
def test_compiled_decode_attention_at_model_shapes(hkv, ratio, d, window, dtype):
    """Real head layouts and contexts up to 2,000 positions (many pages per program), compiled,
    against the reference on the same GPU."""
    g = torch.Generator().manual_seed(hkv * d)
    ctx = torch.randint(1, 2000, (24,), generator=g, dtype=torch.int32)
    ctx[:3] = torch.tensor([1, 16, 2000], dtype=torch.int32)
    blocks = (ctx + 15) // 16
    state = on(random_pages(int(blocks.sum()) + 8, hkv, 16, d, dtype, g), "cuda")
    perm = torch.randperm(int(blocks.sum()) + 8, generator=g)
    bt = torch.full((len(ctx), int(blocks.max())), -1, dtype=torch.int32)
    i = 0
    for s, nb in enumerate(blocks.tolist()):
        bt[s, :nb] = perm[i:i + nb].to(torch.int32)
        i += nb
    q = torch.randn(len(ctx), hkv * ratio, d, generator=g).cuda()
    args = (q, *state, bt.cuda(), ctx.cuda(), window, d ** -0.5)
    got, expect = tkv_cuda.paged_decode_attention(*args), ref.paged_decode_attention(*args)
    assert got.isfinite().all()
    torch.testing.assert_close(got, expect, rtol=2e-5, atol=2e-5)
