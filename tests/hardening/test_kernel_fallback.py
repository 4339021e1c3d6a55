"""A Triton kernel that fails at launch (no C compiler for its launcher, no driver) does not fail
the request: the dispatcher logs it once and runs the PyTorch reference from then on. On CPU the
real compiled (not interpreted) kernels are launched on CPU tensors, which raises inside Triton."""
from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import pytest
import torch

import kvwire_kernels
from kvwire_kernels import dispatch, reference


def compiled_for_cpu_tensors(monkeypatch, name: str, tried: str, loaded: str):
    """kvwire_kernels/<name>.py loaded for real (no interpreter) as the dispatcher's ``loaded`` module,
    with CPU tensors sent down the Triton path, where the real launch fails."""
    if os.environ.get("TRITON_INTERPRET"):
        monkeypatch.delenv("TRITON_INTERPRET")
    pytest.importorskip("triton")
    spec = importlib.util.spec_from_file_location(f"_{name}_for_fallback",
                                                  Path(kvwire_kernels.__file__).parent / f"{name}.py")
    compiled = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compiled)
    monkeypatch.setattr(dispatch, tried, True)
    monkeypatch.setattr(dispatch, loaded, compiled)
    monkeypatch.setattr(dispatch, "_wants_triton", lambda t: True)  # CPU tensors take the Triton path
    return compiled


@pytest.fixture
def failing_triton(monkeypatch):
    return compiled_for_cpu_tensors(monkeypatch, "triton_kv", "_triton_tried", "_triton_kv")


def pages(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(4, 2, 16, 8, generator=g) * 3).to(torch.float8_e4m3fn)
    return k, torch.rand(4, 2, 16, generator=g).to(torch.bfloat16) + 0.1


def test_a_failing_triton_launch_falls_back_to_the_reference_and_logs_once(failing_triton, caplog):
    k, scales = pages()
    ids = torch.tensor([2, 0], dtype=torch.int64)
    with pytest.raises(Exception):  # the premise: the real launch fails here
        failing_triton.dequantize_pages(k, scales, ids)
    with caplog.at_level(logging.ERROR, logger="kvwire_kernels.dispatch"):
        out = dispatch.dequantize_pages(k, scales, ids)
        assert torch.equal(out, reference.dequantize_pages(k, scales, ids))
        assert dispatch._triton_kv is None  # Triton is off for the rest of the process
        k_pages, v_pages = torch.zeros(4, 2, 16, 8, dtype=torch.float8_e4m3fn), torch.zeros(
            4, 2, 16, 8, dtype=torch.float8_e4m3fn)
        k_s, v_s = torch.zeros(4, 2, 16, dtype=torch.bfloat16), torch.zeros(4, 2, 16, dtype=torch.bfloat16)
        new = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
        slots = torch.tensor([5, 17, 40])
        dispatch.write_kv(k_pages, v_pages, k_s, v_s, *new, slots)
        want = [t.clone() for t in (k_pages, v_pages, k_s, v_s)]
        for t in want:
            t.zero_()
        reference.write_kv(*want, *new, slots)
        assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                   for a, b in zip((k_pages, v_pages, k_s, v_s), want))
    failures = [r for r in caplog.records if "failed at launch" in r.getMessage()]
    assert len(failures) == 1 and "dequantize_pages" in failures[0].getMessage()


def test_a_failing_gguf_launch_falls_back_to_the_reference_and_logs_once(monkeypatch, caplog):
    """The GGUF matmul (GGUFLinear on a CUDA device) the same way, and apart from the KV ops."""
    compiled = compiled_for_cpu_tensors(monkeypatch, "triton_gguf", "_gguf_tried", "_triton_gguf")
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (16, 2 * 34), dtype=torch.uint8, generator=g)  # Q8_0, 64 inputs
    raw.view(16, 2, 34)[..., :2] = torch.tensor([0x00, 0x1C], dtype=torch.uint8)  # d = 2**-8 (fp16 0x1C00)
    x = torch.randn(3, 64, generator=g)
    with pytest.raises(Exception):  # the premise: the real launch fails here
        compiled.linear(x, raw, "Q8_0")
    kv_before = dispatch._triton_kv
    with caplog.at_level(logging.ERROR, logger="kvwire_kernels.dispatch"):
        for _ in range(2):
            assert torch.equal(dispatch.linear_gguf(x, raw, "Q8_0"), reference.linear_gguf(x, raw, "Q8_0"))
    assert dispatch._triton_gguf is None and dispatch._triton_kv is kv_before  # the KV kernels are not given up
    failures = [r for r in caplog.records if "failed at launch" in r.getMessage()]
    assert len(failures) == 1 and "Q8_0" in failures[0].getMessage()
