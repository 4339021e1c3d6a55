"""One dispatcher for the KV page ops and the GGUF block matmul: Triton on CUDA tensors, the
PyTorch reference elsewhere (KV writes on CPU: the C kernel where it is built, the same bits).

The choice is made per call from the tensors' device, never from the environment at import
time. Triton is imported lazily, on the first CUDA call: CPU processes never load it (saving its
import time), and it stays possible to set TRITON_INTERPRET=1 before triton is first imported,
which the interpreted kernel tests depend on (triton.jit reads it when decorating).
"""
from __future__ import annotations

import logging
import types

import torch

from kvwire_kernels import cpu, reference

log = logging.getLogger(__name__)

_triton_kv: types.ModuleType | None = None
_triton_tried = False
_triton_gguf: types.ModuleType | None = None  # the GGUF kernels: loaded, and given up on, apart from the KV ones
_gguf_tried = False


def _wants_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def _triton() -> types.ModuleType | None:
    global _triton_kv, _triton_tried
    if not _triton_tried:
        _triton_tried = True
        try:
            from kvwire_kernels import triton_kv
            _triton_kv = triton_kv
        except Exception as e:  # noqa: BLE001 - no triton, or no usable backend: the reference runs on CUDA too
            log.warning("Triton is not usable (%s: %s); the KV page ops run the PyTorch reference", type(e).__name__, e)
            _triton_kv = None
    return _triton_kv


def _call(name: str, t: torch.Tensor, *args):
    """``name`` from Triton when ``t`` is on the GPU and Triton works, else from the reference.

    A Triton kernel is compiled, and its C launcher built with the host's C compiler, at its first
    launch: a failure there (no compiler in the image, no driver, a backend bug) is logged once
    and every later call takes the reference path instead of failing the request. A launch error
    is raised before the kernel writes anything, so the reference redoes the whole op."""
    global _triton_kv
    mod = _triton() if _wants_triton(t) else None
    if mod is not None:
        try:
            return getattr(mod, name)(*args)
        except Exception as e:  # noqa: BLE001
            log.error("Triton kernel %s failed at launch (%s: %s); the KV page ops use the PyTorch reference "
                      "from now on", name, type(e).__name__, e)
            _triton_kv = None
    return getattr(reference, name)(*args)


def write_kv(k_pages, v_pages, k_scale, v_scale, k_new, v_new, slot_mapping) -> None:
    """Quantize and write new K/V into their slots, in place (see ``kvwire_kernels.reference.write_kv``).

    On CPU the C kernel writes the reference's bytes (tested bit for bit) in one call where the
    reference makes a dozen torch calls per layer (its cost: CHANGELOG, serving under load)."""
    pages = (k_pages, v_pages, k_scale, v_scale)
    if not _wants_triton(k_pages) and k_new.dtype == v_new.dtype == torch.float32 \
            and slot_mapping.dtype == torch.int64 and all(t is None or t.is_contiguous() for t in pages) \
            and k_pages.dtype in (reference.FP8_DTYPE, torch.bfloat16) \
            and (k_scale is None) == (k_pages.dtype == torch.bfloat16) \
            and all(t is None or t.dtype == reference.SCALE_DTYPE for t in (k_scale, v_scale)):
        if cpu.available():  # built (or found) on first use
            cpu.write_kv(k_pages, v_pages, k_scale, v_scale, k_new.contiguous(), v_new.contiguous(),
                         slot_mapping.contiguous())
            return
    _call("write_kv", k_pages, k_pages, v_pages, k_scale, v_scale, k_new, v_new, slot_mapping)


def dequantize_pages(pages, scales, page_ids) -> torch.Tensor:
    """float32 [n, num_kv_heads, block_size, head_dim] (see ``kvwire_kernels.reference.dequantize_pages``)."""
    return _call("dequantize_pages", pages, pages, scales, page_ids)


def paged_decode_attention(q, k_pages, v_pages, k_scale, v_scale, block_tables, context_lens,
                           window, sm_scale) -> torch.Tensor:
    """One query per row, GQA over pages (see ``kvwire_kernels.reference.paged_decode_attention``).

    A row is a sequence's block table plus the query's context length, so several queries of
    one sequence (a speculative verification) are several rows sharing a table, in one call."""
    return _call("paged_decode_attention", q, q, k_pages, v_pages, k_scale, v_scale, block_tables,
                 context_lens, window, sm_scale)


def _gguf_kernels() -> types.ModuleType | None:
    global _triton_gguf, _gguf_tried
    if not _gguf_tried:
        _gguf_tried = True
        try:
            from kvwire_kernels import triton_gguf
            _triton_gguf = triton_gguf
        except Exception as e:  # noqa: BLE001 - as _triton
            log.warning("Triton is not usable (%s: %s); GGUF layers run the PyTorch reference", type(e).__name__, e)
            _triton_gguf = None
    return _triton_gguf


def linear_gguf(x: torch.Tensor, raw: torch.Tensor, qtype: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ the GGUF weight ``raw`` (uint8 [out, bytes], the rows of blocks as stored)^T
    (+ bias) -> [rows, out] fp32. On CUDA ``triton_gguf.linear`` (16-bit activations, W4A16), else, or
    once that failed at launch (as ``_call``), ``reference.linear_gguf`` (int8 activation blocks)."""
    global _triton_gguf
    mod = _gguf_kernels() if _wants_triton(x) else None
    if mod is not None:
        try:
            return mod.linear(x, raw, qtype, bias, out_dtype=torch.float32)
        except Exception as e:  # noqa: BLE001
            log.error("Triton kernel linear (%s) failed at launch (%s: %s); GGUF layers use the PyTorch reference "
                      "from now on", qtype, type(e).__name__, e)
            _triton_gguf = None
    return reference.linear_gguf(x.float(), raw, qtype, bias)
