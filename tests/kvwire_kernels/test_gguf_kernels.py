"""GGUF block kernels (kvwire_kernels/cpu/gguf_blocks.c) against the ``gguf`` package and the PyTorch reference.

Dequantization must be ``gguf.quants.dequantize``'s bit for bit; the packing must keep every byte; the
kernels agree with ``reference.linear_gguf`` within fp32 round-off on each instruction path (AVX512-VNNI,
AVX2, plain C: the last two built here for the test), and each row's result is the same bits whatever
it is batched with and on any thread count.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kvwire_kernels import cpu, reference
from tests.kvwire.gguf_files import random_blocks

TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
kernels = pytest.mark.skipif(not cpu.available(), reason=cpu.unavailable_reason or "")


def raw_of(qtype: str, rows: int, cols: int, seed: int, random: bool = False) -> torch.Tensor:
    """uint8 [rows, bytes]: blocks gguf quantized from normal weights, or random bytes (every nibble,
    int8 value and 6-bit scale, small fp16 scales) when ``random`` or for types gguf cannot quantize to."""
    rng = np.random.default_rng(seed)
    if random or qtype.endswith("_K"):
        return torch.from_numpy(random_blocks(rows, cols, Q[qtype], rng))
    return torch.from_numpy(quantize(rng.normal(0, 0.05, (rows, cols)).astype(np.float32), Q[qtype]))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("random", [False, True])
def test_dequantize_is_ggufs_bit_for_bit_and_packing_keeps_every_byte(qtype, random):
    raw = raw_of(qtype, 48, 512, seed=len(qtype), random=random)
    expected = torch.from_numpy(dequantize(raw.numpy(), Q[qtype]))
    ours = reference.dequantize_gguf(raw, qtype)
    assert ours.dtype == torch.float32 and torch.equal(ours.view(torch.int32), expected.view(torch.int32))
    packed = cpu.pack_gguf(raw, qtype)
    values, size = cpu.GGUF_BLOCKS[qtype]
    assert packed.shape == (3, 512 // values, packed.shape[2])
    # not a byte more than the file (Q4_K / Q5_K: their 6-bit scales and mins as bytes, 16 instead of 12)
    assert packed.numel() == raw.numel() + (4 * 48 * 2 if qtype in ("Q4_K", "Q5_K") else 0)
    assert torch.equal(cpu.unpack_gguf(packed, qtype), raw)
    # row 1, block 0: the bytes 4..7 of its first vector field are the second row of that field's vector 1
    _, a, _ = cpu.GGUF_FIELDS[qtype][0]
    assert torch.equal(packed[0, 0, 64 + 4:64 + 8], raw[1, a + 4:a + 8])


def test_pack_refuses_rows_the_kernels_cannot_take():
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu.pack_gguf(raw_of("Q4_0", 40, 64, 0), "Q4_0")


@kernels
def test_activation_blocks_are_the_references_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 256, generator=g) * torch.rand(256, generator=g) * 4
    x[0, :32] = 0  # a zero block: scale 0, q 0
    x[1, 32:64] = torch.arange(32) - 15.5  # ties after scaling: nearest even
    x[2, :64] *= 1e-30
    q, s, sums, sums16 = cpu.quantize_blocks(x)
    q_ref, s_ref = reference.quantize_act8(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    assert torch.equal(sums, q_ref.reshape(4, -1, 32).int().sum(-1, dtype=torch.int32))
    assert torch.equal(sums16, q_ref.reshape(4, -1, 16).int().sum(-1, dtype=torch.int32))


@kernels
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows,n_in,n_out", [(1, 768, 960), (5, 1536, 64), (7, 256, 48), (13, 512, 16)])
def test_gemm_matches_reference(qtype, rows, n_in, n_out):
    g = torch.Generator().manual_seed(rows * n_in + n_out)
    raw = raw_of(qtype, n_out, n_in, seed=rows, random=rows == 5)
    x = torch.randn(rows, n_in, generator=g) * torch.rand(n_in, generator=g) * 3
    bias, res = torch.randn(n_out, generator=g), torch.randn(rows, n_out, generator=g)
    packed = cpu.pack_gguf(raw, qtype)
    ref = reference.linear_gguf(x, raw, qtype, bias) + res
    y = cpu.gemm_gguf(x, packed, qtype, bias, res)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    # the activations were quantized: close to the fp32 product, not equal to it
    exact = res + F.linear(x.double(), reference.dequantize_gguf(raw, qtype).double()).float() + bias
    err = float((y - exact).abs().max() / exact.abs().max())
    assert 0 < err < 0.03, err


@kernels
@pytest.mark.parametrize("qtype", TYPES)
def test_rows_independent_of_batch_and_threads(qtype):
    """21 rows: more than QUANT_SPLIT_ROWS, so the threads quantize halves of the batch; one row
    alone is quantized before the threads start."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(21, 768, generator=g)
    packed = cpu.pack_gguf(raw_of(qtype, 512, 768, seed=3), qtype)
    full = cpu.gemm_gguf(x, packed, qtype, threads=2)
    for i in range(21):
        assert torch.equal(cpu.gemm_gguf(x[i:i + 1].clone(), packed, qtype, threads=1), full[i:i + 1]), i
    assert torch.equal(cpu.gemm_gguf(x[3:11].clone(), packed, qtype, threads=2), full[3:11])


def _build(level: str, tmp_path) -> ctypes.CDLL:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path / f"kvwire_cpu_{level}.so"
    # -O1: the paths' arithmetic is what is tested, and it compiles in a fraction of -O3's time
    subprocess.run([cc, "-O1", "-fopenmp", "-fPIC", "-shared", f"-march={level}", "-o", str(out), str(cpu.SOURCE), "-lm"],
                   check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    lib.kvw_gguf_isa.restype = ctypes.c_int
    for q in TYPES:
        getattr(lib, f"kvw_gemm_{q.lower()}").argtypes = cpu.SIGNATURES[f"kvw_gemm_{q.lower()}"]
    return lib


@pytest.mark.parametrize("level,isa", [("x86-64-v3", 1), ("x86-64", 0)])
def test_avx2_and_plain_c_paths_match_reference(level, isa, tmp_path):
    """The paths this CPU's own build does not take, built for the test: the same numbers."""
    if level == "x86-64-v3" and not {"avx2", "fma", "f16c", "bmi2", "movbe"}.issubset(cpu._cpu_flags().split()):
        pytest.skip("this CPU cannot run an AVX2 build")
    lib = _build(level, tmp_path)
    assert lib.kvw_gguf_isa() == isa
    g = torch.Generator().manual_seed(4)
    for qtype in TYPES:
        raw = raw_of(qtype, 32, 256, seed=5, random=True)
        packed = cpu.pack_gguf(raw, qtype)
        x = torch.randn(5, 256, generator=g)
        ref = reference.linear_gguf(x, raw, qtype)
        rows = {}
        for n in (5, 1):
            y = torch.empty(n, 32)
            getattr(lib, f"kvw_gemm_{qtype.lower()}")(x.data_ptr(), n, 256, packed.data_ptr(), 32, y.data_ptr(),
                                                      None, None, None, 2)
            rows[n] = y
        torch.testing.assert_close(rows[5], ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        assert torch.equal(rows[1], rows[5][:1]), qtype
