"""The CPU decode kernels (kvwire_kernels/cpu) against the PyTorch references they replace.

KV writes must be bit-identical to ``kvwire_kernels.reference.write_kv`` (pages go on the wire and into
checksums); matmuls and attention agree within float32 round-off; and every row's result must not
depend on how many rows share the call (speculative verification relies on it).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvwire_kernels import cpu, reference
from kvwire.kv.pool import RELEASED
from kvwire.model.model import apply_rope

pytestmark = pytest.mark.skipif(not cpu.available(), reason=cpu.unavailable_reason or "")


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,n_in,n_out", [(1, 576, 960), (3, 64, 37), (7, 1536, 576), (16, 40, 13)])
def test_linear_matches_torch(dtype, rows, n_in, n_out):
    g = torch.Generator().manual_seed(rows * n_in + n_out)
    x = torch.randn(rows, n_in, generator=g)
    if dtype is torch.int8:
        w = torch.randint(-127, 128, (n_out, n_in), generator=g, dtype=torch.int8)
    else:
        w = torch.randn(n_out, n_in, generator=g).to(dtype)
    scale, bias, res = torch.rand(n_out, generator=g), torch.randn(n_out, generator=g), torch.randn(rows, n_out, generator=g)
    y = cpu.linear(x, w, scale, bias, res)
    ref = res + (F.linear(x.double(), w.double()) * scale.double() + bias.double()).float()
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * n_in ** 0.5)
    plain = cpu.linear(x, w)
    torch.testing.assert_close(plain, F.linear(x.double(), w.double()).float(), rtol=1e-4, atol=1e-4 * n_in ** 0.5)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16])
def test_linear_rows_independent_of_batch_and_threads(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(13, 576, generator=g)
    w = (torch.randint(-127, 128, (1000, 576), generator=g, dtype=torch.int8) if dtype is torch.int8
         else torch.randn(1000, 576, generator=g).to(dtype))
    full = cpu.linear(x, w, threads=2)
    for i in range(13):
        assert torch.equal(cpu.linear(x[i:i + 1].clone(), w, threads=1), full[i:i + 1])
    assert torch.equal(cpu.linear(x[3:8].clone(), w, threads=2), full[3:8])


vnni = pytest.mark.skipif(not cpu.available() or not cpu.library().kvw_has_vnni(),
                          reason="the int8 x int8 linear needs an AVX512-VNNI build")


@vnni
def test_act8_quantization_is_the_references_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 1536, generator=g) * torch.rand(1536, generator=g) * 4
    x[0, :32] = 0  # a zero block: scale 0, q 0
    x[1, 32:64] = torch.arange(32) - 15.5  # exact halves after scaling: round to nearest even
    x[2, :64] *= 1e-30  # tiny values (subnormal scales)
    x[3, 100] = 1e4  # an outlier: its block saturates to +-127, the others do not care
    q, s, k = cpu.quantize_act8(x)
    q_ref, s_ref = reference.quantize_act8(x)
    assert torch.equal(q, q_ref)
    lanes_per_block = reference.ACT8_BLOCK // 4
    assert torch.equal(s, s_ref.repeat_interleave(lanes_per_block, dim=1))  # every lane of a block: its scale
    # what (w + 128) . q adds over w . q, per row: 128 * sum_b s_b * sum(q_b)
    k_ref = 128 * (s_ref.double() * q_ref.reshape(5, -1, reference.ACT8_BLOCK).double().sum(-1)).sum(-1)
    torch.testing.assert_close(k.double(), k_ref, rtol=1e-6, atol=1e-6 * float(k_ref.abs().max()))


@vnni
@pytest.mark.parametrize("rows,n_in,n_out", [(1, 576, 960), (3, 1536, 576), (9, 64, 37), (16, 2048, 13)])
def test_linear_i8a8_matches_reference(rows, n_in, n_out):
    g = torch.Generator().manual_seed(rows * n_in + n_out)
    x = torch.randn(rows, n_in, generator=g) * torch.rand(n_in, generator=g) * 3
    w = torch.randint(-127, 128, (n_out, n_in), generator=g, dtype=torch.int8)
    scale, bias, res = torch.rand(n_out, generator=g), torch.randn(n_out, generator=g), torch.randn(rows, n_out, generator=g)
    y = cpu.linear_i8a8(x, w, scale, bias, res)
    ref = reference.linear_i8a8(x, w, scale, bias) + res
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    # and the quantization is what it claims: close to the fp32 product, not equal to it
    exact = res + F.linear(x.double(), w.double()).float() * scale + bias
    err = (y - exact).abs().max() / exact.abs().max()
    assert 0 < err < 0.02, err
    with pytest.raises(ValueError, match="multiple of 64"):
        cpu.linear_i8a8(x[:, :32].contiguous(), w[:, :32].contiguous(), scale)


@vnni
def test_linear_i8a8_rows_independent_of_batch_and_threads():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(13, 576, generator=g)
    w = torch.randint(-127, 128, (1000, 576), generator=g, dtype=torch.int8)
    scale = torch.rand(1000, generator=g)
    full = cpu.linear_i8a8(x, w, scale, threads=2)
    for i in range(13):
        assert torch.equal(cpu.linear_i8a8(x[i:i + 1].clone(), w, scale, threads=1), full[i:i + 1])
    assert torch.equal(cpu.linear_i8a8(x[3:8].clone(), w, scale, threads=2), full[3:8])


@vnni
@pytest.mark.parametrize("rows,n_in,n_out", [(1, 576, 960), (5, 1536, 576), (12, 64, 48), (13, 576, 16), (129, 128, 64)])
def test_gemm_i8a8_matches_reference(rows, n_in, n_out):
    """The packed GEMM (prefill, and the fused step's int8 layers) against the float64 reference,
    across row tiles of 12 and their tails."""
    g = torch.Generator().manual_seed(rows * n_in + n_out)
    x = torch.randn(rows, n_in, generator=g) * torch.rand(n_in, generator=g) * 3
    w = torch.randint(-127, 128, (n_out, n_in), generator=g, dtype=torch.int8)
    scale, bias, res = torch.rand(n_out, generator=g), torch.randn(n_out, generator=g), torch.randn(rows, n_out, generator=g)
    packed = cpu.pack_i8a8(w)
    assert packed.shape == (n_out // 16, n_in // 4, 16, 4) and packed.dtype == torch.uint8
    assert packed[0, 0, 1, 2].item() == (int(w[1, 2]) & 0xFF) ^ 0x80  # output 1, input 2
    assert torch.equal(cpu.unpack_i8a8(packed), w)
    y = cpu.gemm_i8a8(x, packed, scale, bias, res)
    ref = reference.linear_i8a8(x, w, scale, bias) + res
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    torch.testing.assert_close(cpu.gemm_i8a8(x, packed, scale), reference.linear_i8a8(x, w, scale),
                               rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_pack_i8a8_refuses_shapes_the_gemm_cannot_take():
    w = torch.zeros(40, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="% 16"):
        cpu.pack_i8a8(w)
    with pytest.raises(ValueError, match="% 64"):
        cpu.pack_i8a8(torch.zeros(48, 96, dtype=torch.int8))


@vnni
def test_gemm_i8a8_rows_independent_of_batch_and_threads():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(29, 576, generator=g)
    packed = cpu.pack_i8a8(torch.randint(-127, 128, (1024, 576), generator=g, dtype=torch.int8))
    scale = torch.rand(1024, generator=g)
    full = cpu.gemm_i8a8(x, packed, scale, threads=2)
    for i in range(29):
        assert torch.equal(cpu.gemm_i8a8(x[i:i + 1].clone(), packed, scale, threads=1), full[i:i + 1])
    assert torch.equal(cpu.gemm_i8a8(x[3:20].clone(), packed, scale, threads=2), full[3:20])


@pytest.mark.skipif(not cpu.amx(), reason="library built without AMX-INT8, tile state refused, or KVWIRE_AMX=0")
@pytest.mark.parametrize("n_in,n_out", [(576, 960), (1536, 576), (64, 16)])
def test_gemm_i8a8_on_amx_tiles_gives_vnnis_bits(n_in, n_out):
    """Tiles of 16 rows, a partial tile of 3-15 on AMX and a shorter tail on VNNI: every row the
    same bits as the VNNI kernel alone computes, on 1 and 2 threads, with bias and residual."""
    g = torch.Generator().manual_seed(n_in + n_out)
    w = torch.randint(-128, 128, (n_out, n_in), generator=g, dtype=torch.int8)
    packed, scale, bias = cpu.pack_i8a8(w), torch.rand(n_out, generator=g), torch.randn(n_out, generator=g)
    lib = cpu.library()
    try:
        for rows in (2, 3, 5, 9, 12, 16, 17, 18, 19, 31, 32, 45):
            x = torch.randn(rows, n_in, generator=g) * torch.rand(rows, 1, generator=g) * 5
            x[0, :32] = 0  # a block of zeros: scale 0
            res = torch.randn(rows, n_out, generator=g)
            lib.kvw_set_amx(0)
            vnni = cpu.gemm_i8a8(x, packed, scale, bias, res, threads=2)
            assert lib.kvw_set_amx(1) == 1
            for threads in (1, 2):
                assert torch.equal(cpu.gemm_i8a8(x, packed, scale, bias, res, threads=threads), vnni), (rows, threads)
    finally:
        cpu.amx()  # back to what the environment says


def test_amx_switch(monkeypatch):
    monkeypatch.setenv("KVWIRE_AMX", "0")
    assert not cpu.amx()
    monkeypatch.setenv("KVWIRE_AMX", "auto")
    flags = cpu._cpu_flags().split()
    assert cpu.amx() == (cpu.available() and cpu.library().kvw_set_amx(1) == 1)
    if not {"amx_tile", "amx_int8"}.issubset(flags):
        assert not cpu.amx()


@pytest.mark.skipif(not cpu.bf16_activations(), reason="library built without AVX512-BF16 (or KVWIRE_BF16_ACTIVATIONS=0)")
@pytest.mark.parametrize("rows,n_in,n_out", [(1, 576, 960), (5, 1536, 576), (9, 96, 37), (16, 64, 13)])
def test_linear_bf16a16_rounds_activations_to_bf16_and_rows_stay_independent(rows, n_in, n_out):
    """bf16 x bf16 (vdpbf16ps): the products of x rounded to bf16 and the stored weights, summed in
    fp32 (96 = one 64-input step and a 32-input tail); a row alone gives the same bits."""
    g = torch.Generator().manual_seed(rows + n_in)
    x, w = torch.randn(rows, n_in, generator=g) * 3, torch.randn(n_out, n_in, generator=g).bfloat16()
    scale, bias, res = torch.rand(n_out, generator=g), torch.randn(n_out, generator=g), torch.randn(rows, n_out, generator=g)
    y = cpu.linear_bf16a16(x, w, scale, bias, res, threads=2)
    ref = res + (F.linear(x.bfloat16().double(), w.double()) * scale.double() + bias.double()).float()
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * n_in ** 0.5)
    fp32_x = res + (F.linear(x.double(), w.double()) * scale.double() + bias.double()).float()
    assert not torch.allclose(y, fp32_x, rtol=1e-6, atol=1e-6)  # the activations were rounded
    for i in range(rows):
        alone = cpu.linear_bf16a16(x[i:i + 1].clone(), w, scale, bias, res[i:i + 1].clone(), threads=1)
        assert torch.equal(alone, y[i:i + 1]), i


def test_rms_norm_and_silu_mul():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 576, generator=g), torch.rand(576, generator=g)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5))
    gu = torch.randn(4, 2 * 96, generator=g)
    torch.testing.assert_close(cpu.silu_mul(gu), F.silu(gu[:, :96]) * gu[:, 96:])
    # 16 at a time plus a scalar tail (100 = 6 x 16 + 4), gates far past exp's range both ways
    gu = torch.randn(3, 2 * 100, generator=g) * torch.tensor([1.0, 30.0, 200.0])[:, None]
    torch.testing.assert_close(cpu.silu_mul(gu), F.silu(gu[:, :100]) * gu[:, 100:])


def test_rope_split_matches_model():
    g = torch.Generator().manual_seed(2)
    h, hkv, d, n = 9, 3, 64, 4
    qkv = torch.randn(n, (h + 2 * hkv) * d, generator=g)
    ang = torch.rand(n, d // 2, generator=g) * 10
    emb = torch.cat((ang, ang), -1)
    cos, sin = emb.cos(), emb.sin()
    q, k, v = cpu.rope_split(qkv, h, hkv, d, cos, sin)
    rq, rk, rv = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    torch.testing.assert_close(q, apply_rope(rq.reshape(n, h, d), cos[:, None], sin[:, None]))
    torch.testing.assert_close(k, apply_rope(rk.reshape(n, hkv, d), cos[:, None], sin[:, None]))
    assert torch.equal(v, rv.reshape(n, hkv, d))


def _pages(fp8: bool, num_pages=12, hkv=3, bs=16, d=64):
    dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    k, v = torch.zeros(num_pages, hkv, bs, d, dtype=dt), torch.zeros(num_pages, hkv, bs, d, dtype=dt)
    ks = vs = None
    if fp8:
        ks, vs = torch.zeros(num_pages, hkv, bs, dtype=torch.bfloat16), torch.zeros(num_pages, hkv, bs, dtype=torch.bfloat16)
    return k, v, ks, vs


def _raw(t):
    return None if t is None else t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int16)


@pytest.mark.parametrize("fp8", [True, False])
def test_write_kv_bit_exact(fp8):
    g = torch.Generator().manual_seed(3)
    n = 40
    k_new = torch.randn(n, 3, 64, generator=g) * torch.logspace(-8, 3, n)[:, None, None]
    v_new = torch.randn(n, 3, 64, generator=g)
    k_new[0] = 0.0  # an all-zero token: the scale floor
    k_new[1, 0, :5] = torch.tensor([1e-30, -3e-40, 448.0, 1e6, -2.5e-3])  # subnormals, huge, ties
    slots = torch.randperm(12 * 16, generator=g)[:n]
    ours, ref = _pages(fp8), _pages(fp8)
    cpu.write_kv(*ours, k_new, v_new, slots)
    reference.write_kv(*ref, k_new, v_new, slots)
    for a, b in zip(ours, ref):
        if a is not None:
            assert torch.equal(_raw(a), _raw(b))


@pytest.mark.parametrize("fp8", [True, False])
def test_dispatch_writes_kv_through_the_c_kernel_with_the_reference_bytes(fp8, monkeypatch):
    """The paged cache's writes (kvwire_kernels.dispatch) take the C kernel on CPU, from the strided
    views a model's split gives, and the pages hold what the reference writes."""
    from kvwire_kernels import dispatch
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(24, 5 * 64, generator=g) * 4
    k_new, v_new = qkv[:, 3 * 64:4 * 64].view(24, 1, 64), qkv[:, 4 * 64:].view(24, 1, 64)  # strided
    slots = torch.randperm(12 * 16, generator=g)[:24]
    called = []
    real = cpu.write_kv
    monkeypatch.setattr(cpu, "write_kv", lambda *a: (called.append(1), real(*a))[1])
    ours, ref = _pages(fp8, hkv=1), _pages(fp8, hkv=1)
    dispatch.write_kv(*ours, k_new, v_new, slots)
    reference.write_kv(*ref, k_new, v_new, slots)
    assert called == [1]
    for a, b in zip(ours, ref):
        if a is not None:
            assert torch.equal(_raw(a), _raw(b))


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("window", [None, 20])
def test_paged_attention_matches_reference(fp8, window):
    g = torch.Generator().manual_seed(4)
    k, v, ks, vs = _pages(fp8)
    slots = torch.arange(12 * 16)
    reference.write_kv(k, v, ks, vs, torch.randn(192, 3, 64, generator=g) * 2, torch.randn(192, 3, 64, generator=g), slots)
    order = torch.randperm(12, generator=g).tolist()
    tables = [order[:6], order[6:], order[:6]]
    ctx = [90, 33, 7]
    q = torch.randn(3, 9, 64, generator=g)
    bt = torch.tensor(tables, dtype=torch.int32)
    if window is not None:
        bt[0, 0] = RELEASED  # behind the window of row 0 (positions 0..15, row 0 sees 70..89)
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    ours = cpu.paged_attention(q, k, v, ks, vs, bt, ctx_t, window, 0.125)
    ref = reference.paged_decode_attention(q, k, v, ks, vs, bt, ctx_t, window, 0.125)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    for i in range(3):  # each row alone gives the same bits
        alone = cpu.paged_attention(q[i:i + 1].clone(), k, v, ks, vs, bt[i:i + 1].clone(), ctx_t[i:i + 1].clone(),
                                    window, 0.125, threads=1)
        assert torch.equal(alone, ours[i:i + 1])


def test_paged_attention_reads_every_fp8_byte_exactly():
    """A one-position context returns its V row times its scale: every e4m3 byte (subnormals, both
    zeros, the largest; not NaN) must come out as torch's float8 value, exactly, though the kernel
    converts through fp16 with 2^8 folded into the scale."""
    k, v, ks, vs = _pages(True, num_pages=1, hkv=4)
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] -= 1  # 0x7F / 0xFF are e4m3fn's NaN, which the quantizer never writes
    v.view(torch.uint8)[0, :, 0] = codes.view(4, 64)
    ks[0, :, 0], vs[0, :, 0] = 1.0, torch.tensor([0.75, 3.0, 2.0 ** -20, 448.0])
    out = cpu.paged_attention(torch.randn(1, 4, 64), k, v, ks, vs, torch.zeros(1, 1, dtype=torch.int32),
                              torch.ones(1, dtype=torch.int32), None, 0.125)
    want = v[0, :, 0].float() * vs[0, :, 0].float()[:, None]
    assert torch.equal(out[0], want)


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("window", [None, 20])
def test_paged_attention_groups_a_sequences_rows_without_changing_a_bit(fp8, window):
    """Rows of one sequence at consecutive positions (a verification; 20 rows: more than one group
    of 16), then a row of another sequence and one more of the first, which must not join its
    group: the kernel reads each K/V position once per group, and every row's output equals the
    row computed alone, bit for bit."""
    g = torch.Generator().manual_seed(5)
    k, v, ks, vs = _pages(fp8)
    reference.write_kv(k, v, ks, vs, torch.randn(192, 3, 64, generator=g) * 2, torch.randn(192, 3, 64, generator=g),
                       torch.arange(12 * 16))
    order = torch.randperm(12, generator=g).tolist()
    tables = [order[:6]] * 20 + [order[6:], order[:6]]
    ctx = list(range(60, 80)) + [80, 81]
    bt, ctx_t = torch.tensor(tables, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32)
    q = torch.randn(len(ctx), 9, 64, generator=g)
    together = cpu.paged_attention(q, k, v, ks, vs, bt, ctx_t, window, 0.125, threads=2)
    ref = reference.paged_decode_attention(q, k, v, ks, vs, bt, ctx_t, window, 0.125)
    torch.testing.assert_close(together, ref, rtol=1e-5, atol=1e-5)
    for i in range(len(ctx)):
        alone = cpu.paged_attention(q[i:i + 1].clone(), k, v, ks, vs, bt[i:i + 1].clone(), ctx_t[i:i + 1].clone(),
                                    window, 0.125, threads=1)
        assert torch.equal(alone, together[i:i + 1]), i


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("d,bs,window", [(64, 16, None), (64, 16, 40), (128, 8, 70), (32, 32, None)])
def test_paged_attention_over_many_chunks_and_windows(fp8, d, bs, window):
    """Contexts of several position chunks (the kernel splits a row's positions into fixed chunks,
    one task each, and merges their softmax partials), a verification group of 12 rows straddling
    chunk boundaries (with a window, its first rows reach chunks its last rows do not), page sizes
    other than 16 and head dims 32 and 128: within round-off of the reference, and each row's bits
    alone equal its bits in the group, on 1 thread and on 2."""
    g = torch.Generator().manual_seed(6 + d + bs)
    pages = 400 // bs + 1
    k, v, ks, vs = _pages(fp8, num_pages=pages, bs=bs, d=d)
    n = pages * bs
    reference.write_kv(k, v, ks, vs, torch.randn(n, 3, d, generator=g) * 2, torch.randn(n, 3, d, generator=g),
                       torch.arange(n))
    order = torch.randperm(pages, generator=g).tolist()
    ctx = list(range(120, 132)) + [400, 1, 65]
    tables = [order] * 12 + [order, order[::-1], order]
    bt, ctx_t = torch.tensor(tables, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32)
    if window is not None:  # pages wholly behind every row's window are given back
        for s, c in enumerate(ctx):
            for b in range((c - window) // bs if c > window else 0):
                bt[s, b] = RELEASED
    q = torch.randn(len(ctx), 9, d, generator=g)
    together = cpu.paged_attention(q, k, v, ks, vs, bt, ctx_t, window, d ** -0.5, threads=2)
    ref = reference.paged_decode_attention(q, k, v, ks, vs, bt, ctx_t, window, d ** -0.5)
    torch.testing.assert_close(together, ref, rtol=1e-5, atol=1e-5)
    for threads in (1, 2):
        for i in range(len(ctx)):
            alone = cpu.paged_attention(q[i:i + 1].clone(), k, v, ks, vs, bt[i:i + 1].clone(), ctx_t[i:i + 1].clone(),
                                        window, d ** -0.5, threads=threads)
            assert torch.equal(alone, together[i:i + 1]), (threads, i)


def _probe(env: dict) -> str:
    import os
    import subprocess
    import sys
    code = ("from kvwire_kernels import cpu; lib = cpu.library(); "
            "print(lib._name if lib else 'None', cpu.unavailable_reason, lib and lib.kvw_has_vnni(), lib and lib.kvw_has_bf16(), "
            "lib and lib.kvw_set_amx(1))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, **env}).stdout.strip()


@pytest.mark.parametrize("n,ctx,h,hkv,d,window", [
    (512, 0, 9, 3, 64, None),  # SmolLM2's heads, one fresh prompt
    (37, 0, 9, 3, 64, None),  # rows not a multiple of a task's 4
    (100, 250, 8, 2, 128, None),  # a later chunk after 250 positions of context, head_dim 128
    (300, 0, 4, 4, 32, 64),  # no GQA, a sliding window shorter than the prompt
    (200, 100, 9, 3, 64, 50),  # window and context
    (5, 40, 6, 2, 16, None),
])
def test_prefill_attention_matches_masked_sdpa_and_ignores_threads(n, ctx, h, hkv, d, window):
    from kvwire.kv.dense import attention_mask, sdpa_gqa
    g = torch.Generator().manual_seed(n + ctx)
    q = torch.randn(n, h, d, generator=g)
    k, v = torch.randn(ctx + n, hkv, d, generator=g), torch.randn(ctx + n, hkv, d, generator=g)
    q0, k0 = 7 + ctx, 7  # positions: keys from 7, the queries are the keys' last n
    out = cpu.prefill_attention(q, k, v, q0, k0, window, d ** -0.5)
    mask = attention_mask(torch.arange(q0, q0 + n), torch.arange(k0, k0 + ctx + n), window)
    torch.testing.assert_close(out, sdpa_gqa(q, k, v, mask), rtol=1e-5, atol=1e-5)
    assert torch.equal(out, cpu.prefill_attention(q, k, v, q0, k0, window, d ** -0.5, threads=1))
    # a row's result does not depend on the rows computed beside it (chunk boundaries)
    assert torch.equal(out[-3:], cpu.prefill_attention(q[-3:], k, v, q0 + n - 3, k0, window, d ** -0.5))


def test_prefill_attention_refuses_queries_outside_the_keys():
    q, k = torch.randn(4, 2, 16), torch.randn(4, 2, 16)
    with pytest.raises(ValueError, match="outside keys"):
        cpu.prefill_attention(q, k, k, 1, 0, None, 0.25)  # the last query at 4, keys end at 3


def test_prebuilt_binaries_serve_where_there_is_no_compiler(tmp_path):
    built = cpu.prebuild(tmp_path)
    assert {p.name.split("_")[2] for p in built} == set(cpu.LEVELS)
    out = _probe({"CC": str(tmp_path / "no-such-cc"), "KVWIRE_KERNEL_PREBUILT": str(tmp_path),
                  "KVWIRE_KERNEL_CACHE": str(tmp_path / "cache")})
    flags = set(cpu._cpu_flags().split())
    best = next(level for level, need in cpu.LEVELS.items() if flags.issuperset(need))
    assert out.startswith(str(cpu.prebuilt_path(best, tmp_path))), out
    # the binary has the int8, bf16 and AMX paths exactly where the CPU (and, for AMX, the kernel) does
    amx = int({"amx_tile", "amx_int8"}.issubset(flags) and cpu.available() and cpu.library().kvw_set_amx(1) == 1)
    cpu.amx()  # the switch back to what the environment says
    assert out.endswith(f"{int('avx512_vnni' in flags)} {int('avx512_bf16' in flags)} {amx}"), out


def test_no_compiler_and_no_prebuilt_falls_back_with_a_reason(tmp_path):
    out = _probe({"CC": str(tmp_path / "no-such-cc"), "KVWIRE_KERNEL_PREBUILT": str(tmp_path),
                  "KVWIRE_KERNEL_CACHE": str(tmp_path / "cache")})
    assert out.startswith("None CPU kernels unavailable:") and "no-such-cc" in out
