"""Triton GGUF block kernels (kvwire_kernels/triton_gguf.py, W4A16) against the PyTorch reference.

Interpreted (TRITON_INTERPRET=1, CPU tensors) everywhere, compiled on a CUDA device where there is
one (those cases skip elsewhere), as tests/kvwire_kernels/test_kernels.py loads its kernels. The
dequantize kernel must give ``reference.dequantize_gguf``'s bits (``gguf.quants.dequantize``'s);
``linear`` multiplies the weight's integers exactly and applies the fp32 scales after each
sub-block's dot, so against the float64 product of the same 16-bit activations and the dequantized
weight it may differ only by fp32 summation: |err| <= 1e-5 * sum_k |x_k w_k| (one wrong nibble is
about 100 times that at these sizes).

Triton 3.9's interpreter multiplies bf16 operands of tl.dot as their uint16 storage (integers); the
``interpreted`` fixture gives its dot bf16's values (widened to fp32, exact), as a GPU's MMA takes them.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import kvwire_kernels
from kvwire_kernels import reference
from tests.kvwire_kernels.test_gguf_kernels import raw_of

CUDA = torch.cuda.is_available()
TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def load_kernels(name: str):
    """A fresh copy of kvwire_kernels/triton_gguf.py: its kernels are decorated as TRITON_INTERPRET says now."""
    spec = importlib.util.spec_from_file_location(name, Path(kvwire_kernels.__file__).parent / "triton_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


if CUDA:  # compiled first, as in test_kernels.py
    os.environ.pop("TRITON_INTERPRET", None)
    import triton  # noqa: F401
    tg_cuda = load_kernels("_triton_gguf_compiled")
_before = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
tg = load_kernels("_triton_gguf_interpreted")
if _before is None:  # set only while an interpreted test runs (see test_kernels.py)
    del os.environ["TRITON_INTERPRET"]

_ON_CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA device"))


def _bf16_dot_as_values(monkeypatch) -> None:
    from triton.language import bfloat16, float32
    from triton.runtime import interpreter
    dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *rest):
        if a.dtype.scalar == bfloat16:  # both operands: tl.dot wants one dtype
            a, b = self.cast_impl(a, float32), self.cast_impl(b, float32)
        return dot(self, a, b, d, *rest)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.fixture(params=["interpreted", _ON_CUDA])
def backend(request, monkeypatch):
    """(kernel module, device)."""
    if request.param == "interpreted":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        _bf16_dot_as_values(monkeypatch)
        return tg, "cpu"
    return tg_cuda, "cuda"


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_kernel_is_the_references_bit_for_bit(qtype, backend):
    tk, dev = backend
    for random in (False, True):  # gguf-quantized normal weights (K types: random), and random bytes
        raw = raw_of(qtype, 48, 512, seed=3, random=random)  # 48 rows: a partial tile of 32
        got = tk.dequantize(raw.to(dev), qtype).cpu()
        want = reference.dequantize_gguf(raw, qtype)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), random  # -0.0 included


def check_linear(tk, dev, qtype, x, raw, bias=None) -> torch.Tensor:
    """Run ``linear`` and check it against the float64 product; returns its output (on the CPU)."""
    y = tk.linear(x.to(dev), raw.to(dev), qtype, None if bias is None else bias.to(dev), out_dtype=torch.float32).cpu()
    x16 = (x if x.dtype != torch.float32 else x.bfloat16()).double()  # fp32 activations go in as bf16
    w = reference.dequantize_gguf(raw, qtype).double()  # [out, in]
    exact = x16 @ w.T + (0 if bias is None else bias.double())
    bound = 1e-5 * (x16.abs() @ w.abs().T) + 1e-30
    assert y.shape == exact.shape and y.dtype == torch.float32
    err = (y.double() - exact).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    return y


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_linear_is_the_dequantized_product(qtype, dtype, backend):
    tk, dev = backend
    g = torch.Generator().manual_seed(len(qtype) + dtype.itemsize)
    rows, n_in, n_out = (5, 512, 48) if dtype != torch.bfloat16 else (1, 256, 32)
    raw = raw_of(qtype, n_out, n_in, seed=rows, random=True)
    x = (torch.randn(rows, n_in, generator=g) * torch.rand(n_in, generator=g) * 4).to(dtype)
    bias = torch.randn(n_out, generator=g) if dtype == torch.float16 else None
    check_linear(tk, dev, qtype, x, raw, bias)


def test_fp32_activations_are_rounded_to_bf16_not_quantized(backend):
    """The W4A16 contract from the fp32 side: the error against the fp32 product is bf16's rounding
    of x (2^-9 relative), far below int8 activation blocks' (the reference's, 2^-8 of a block's amax)."""
    tk, dev = backend
    g = torch.Generator().manual_seed(7)
    raw = raw_of("Q4_0", 32, 256, seed=1)
    x = torch.randn(3, 256, generator=g)
    x[:, 5] = 40.0  # an outlier: int8 blocks lose the small values beside it, bf16 keeps them
    y = check_linear(tk, dev, "Q4_0", x, raw)
    w = reference.dequantize_gguf(raw, "Q4_0").double()
    exact = x.double() @ w.T
    scale = x.double().abs() @ w.abs().T
    ours = float(((y.double() - exact).abs() / scale).max())
    int8 = float(((reference.linear_gguf(x, raw, "Q4_0").double() - exact).abs() / scale).max())
    assert ours <= 2.0 ** -9 and ours < int8 / 4, (ours, int8)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_split_inputs_sum_to_the_same_product(qtype, backend):
    """Decode-sized batches split the inputs into equal parts, one program each (more programs to
    stream the weight); the partials, bias after, are the product within the same bound."""
    tk, dev = backend
    g = torch.Generator().manual_seed(11)
    raw = raw_of(qtype, 32, 512, seed=4, random=True)  # 16 (Q6_K 32) sub-blocks per row
    x = torch.randn(2, 512, generator=g).half()
    bias = torch.randn(32, generator=g)
    whole = check_linear(tk, dev, qtype, x, raw, bias)
    for split in (2, 4):
        parts = tk.linear(x.to(dev), raw.to(dev), qtype, bias.to(dev), out_dtype=torch.float32, split=split).cpu()
        torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="split 3 does not divide"):
        tk.linear(x.to(dev), raw.to(dev), qtype, split=3)


def test_splits_fill_the_device_for_decode_only():
    """TinyLlama-1.1B on an H100 (132 SMs): o and down get about two programs per SM, wide layers and
    batches of more than 16 rows none; without a GPU, no split."""
    assert tg.splits(1, 2048, 176, 132) == 4  # down: 64 tiles, 5 wanted, 4 divides 176
    assert tg.splits(16, 2048, 64, 132) == 4 and tg.splits(17, 2048, 64, 132) == 1
    assert tg.splits(1, 11264, 64, 132) == 1 and tg.splits(1, 2048, 64, 0) == 1
    assert tg.splits(1, 64, 16, 132) == 2  # at least 8 sub-blocks a split


def test_rows_of_a_tile_keep_their_bits(backend):
    """Each output sums its sub-blocks in one order whatever the other rows of its tile (up to 16
    rows: one tile shape): a row's result is the same bits alone and in a batch."""
    tk, dev = backend
    g = torch.Generator().manual_seed(3)
    raw = raw_of("Q4_K", 32, 256, seed=2)
    x = torch.randn(7, 256, generator=g).half()
    batch = check_linear(tk, dev, "Q4_K", x, raw)
    for r in (0, 6):
        alone = tk.linear(x[r:r + 1].to(dev), raw.to(dev), "Q4_K", out_dtype=torch.float32).cpu()
        assert torch.equal(alone[0], batch[r])


def test_linear_refuses_a_width_that_is_not_the_weights(backend):
    tk, dev = backend
    with pytest.raises(ValueError, match="256 inputs, the Q8_0 weight 512"):
        tk.linear(torch.zeros(1, 256, dtype=torch.float16, device=dev), raw_of("Q8_0", 16, 512, 0).to(dev), "Q8_0")


@pytest.mark.parametrize("qtype", TYPES)
def test_kernels_compile_for_an_h100_and_feed_16_bit_mma(qtype, monkeypatch):
    """The interpreter accepts code the compiler refuses: compile both kernels to sm_90 here, without
    a GPU (the triton wheel carries ptxas), and check the weight reaches the tensor cores in bf16."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tk = load_kernels("_triton_gguf_for_sm90")  # decorated for the compiler, not the interpreter
    consts = {"FMT": tk.FORMATS[qtype], "SUB": tk.SUB_BLOCK[qtype], "HAS_MIN": qtype in tk.HAS_MIN}
    ints = dict.fromkeys(("M", "N", "split_len", "row_bytes", "stride_xm", "stride_ys", "stride_ym"), "i32")
    sig = {"x": "*bf16", "w": "*u8", "bias": "*fp32", "y": "*fp32", **ints,
           **dict.fromkeys((*consts, "HAS_BIAS", "BLOCK_M", "BLOCK_N"), "constexpr")}
    block_m, block_n, _ = tk.tiles(1)
    linear = triton_compile(ASTSource(tk._linear_kernel, sig, {**consts, "HAS_BIAS": True, "BLOCK_M": block_m,
                                                               "BLOCK_N": block_n}), target=GPUTarget("cuda", 90, 32))
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in linear.asm["ptx"]
    sig = {"w": "*u8", "out": "*fp32", **dict.fromkeys(("N", "n_sub", "row_bytes"), "i32"),
           **dict.fromkeys((*consts, "BLOCK_N"), "constexpr")}
    assert triton_compile(ASTSource(tk._dequant_kernel, sig, {**consts, "BLOCK_N": 32}),
                          target=GPUTarget("cuda", 90, 32)).asm["cubin"]


# ---- GGUFLinear off the CPU; CUDA only: the layer and a model on the device ---------------------

@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q6_K"])
def test_gguf_linear_leaving_the_cpu_unpacks_on_the_new_device(qtype):
    """The CPU's panels become the rows as stored with torch ops on the device they moved to (the
    meta device here: shapes, and no copy back through the CPU; the bits are checked on CUDA below)."""
    from kvwire.model.gguf_linear import GGUFLinear
    raw = raw_of(qtype, 32, 512, seed=0, random=True)
    layer = GGUFLinear(raw, qtype, 512)
    assert layer.packed.shape != raw.shape  # the CPU's panels
    layer.to("meta")
    assert layer.packed.device.type == "meta" and layer.packed.shape == raw.shape and layer.raw_blocks() is layer.packed


cuda_only = pytest.mark.skipif(not CUDA, reason="no CUDA device")


@cuda_only
@pytest.mark.parametrize("qtype", TYPES)
def test_gguf_linear_moves_its_bytes_and_runs_triton_on_cuda(qtype):
    from kvwire.model.gguf_linear import GGUFLinear
    raw = raw_of(qtype, 64, 512, seed=5, random=True)
    layer = GGUFLinear(raw, qtype, 512)
    layer.bias = torch.randn(64)
    cpu_packed = layer.packed.clone()
    layer.to("cuda")
    assert layer.packed.is_cuda and torch.equal(layer.packed.cpu(), raw)  # the rows as stored, every bit
    x = torch.randn(9, 512, device="cuda")
    check_linear(tg_cuda, "cuda", qtype, x.cpu(), raw, layer.bias.cpu())
    y = layer(x)
    assert y.dtype == torch.float32 and y.is_cuda
    torch.testing.assert_close(y.cpu(), tg_cuda.linear(x, raw.cuda(), qtype, layer.bias, torch.float32).cpu(),
                               rtol=0, atol=0)
    assert torch.equal(layer.dequantized_weight().cpu(), reference.dequantize_gguf(raw, qtype))
    layer.cpu()
    assert torch.equal(layer.packed, cpu_packed)  # back in the C kernels' panels


@cuda_only
def test_q4_k_m_like_model_on_cuda_keeps_its_blocks_and_its_logits(tmp_path):
    """A Q4_K_M-like file served with ``--weights gguf --device cuda``: every layer on its blocks in GPU
    memory, the prompt's logits close to the CPU's fp32 model of the same file (the same weights)."""
    from gguf import GGMLQuantizationType as Q

    from kvwire.config import KVDtype, WeightsMode
    from kvwire.model.gguf_linear import GGUFLinear, GGUFRows
    from kvwire.runtime import EngineConfig, load_engine
    from tests.kvwire.gguf_files import tiny_bpe, write_random
    tok = tiny_bpe()
    types = {"attn_v.weight": Q.Q6_K, "ffn_down.weight": Q.Q6_K, "ffn_up.weight": Q.Q8_0}
    path = write_random(tmp_path / "mixed.gguf", Q.Q4_K, tok, layers=2, types=types)
    gpu = load_engine(EngineConfig(path, weights=WeightsMode.GGUF, kv_dtype=KVDtype.BF16, num_pages=32, device="cuda"))
    cpu_fp32 = load_engine(EngineConfig(path, weights=WeightsMode.NONE, kv_dtype=KVDtype.BF16, num_pages=32))
    for block in gpu.model.layers:
        assert isinstance(block.attn.qkv, GGUFRows) and isinstance(block.mlp.down, GGUFLinear)
        assert all(p.packed.is_cuda for p in block.attn.qkv.parts)
    ids = tok.encode("What is the capital of France? The for statement").ids
    out = []
    for eng in (gpu, cpu_fp32):
        dev = eng.cfg.device
        cache = eng.new_cache()
        logits = eng.model(torch.tensor(ids, device=dev), cache.prepare([0], [len(ids)]), cache,
                           logits_rows=torch.tensor([len(ids) - 1], device=dev))
        out.append(logits.float().cpu())
    err = float((out[0] - out[1]).abs().max() / out[1].abs().max())
    # The same weights; activations into GGUF layers rounded to bf16 (on the CPU, that rounding alone
    # gives 0.021 on this file, int8 activation blocks 0.056): the CPU tests' bound.
    assert 0 < err < 0.05, err
    assert np.isfinite(out[0].numpy()).all()
