"""One dispatcher for the KV page ops: Triton on CUDA tensors, the PyTorch reference elsewhere.

The choice is made per call from the tensors' device, never from the environment at import
time. Triton is imported lazily, on the first CUDA call: CPU processes never load it (saving its
import time), and it stays possible to set TRITON_INTERPRET=1 before triton is first imported,
which the interpreted kernel tests depend on (triton.jit reads it when decorating).
"""
from __future__ import annotations

import types

import torch

from kvwire_kernels import reference

_triton_kv: types.ModuleType | None = None
_triton_tried = False


def _impl(t: torch.Tensor) -> types.ModuleType:
    global _triton_kv, _triton_tried
    if not t.is_cuda:
        return reference
    if not _triton_tried:
        _triton_tried = True
        try:
            from kvwire_kernels import triton_kv
            _triton_kv = triton_kv
        except Exception:  # noqa: BLE001 - no triton, or no usable backend: the reference runs on CUDA too
            _triton_kv = None
    return _triton_kv or reference


def write_kv(k_pages, v_pages, k_scale, v_scale, k_new, v_new, slot_mapping) -> None:
    """Quantize and write new K/V into their slots, in place (see ``kvwire_kernels.reference.write_kv``)."""
    _impl(k_pages).write_kv(k_pages, v_pages, k_scale, v_scale, k_new, v_new, slot_mapping)


def dequantize_pages(pages, scales, page_ids) -> torch.Tensor:
    """float32 [n, num_kv_heads, block_size, head_dim] (see ``kvwire_kernels.reference.dequantize_pages``)."""
    return _impl(pages).dequantize_pages(pages, scales, page_ids)


def paged_decode_attention(q, k_pages, v_pages, k_scale, v_scale, block_tables, context_lens,
                           window, sm_scale) -> torch.Tensor:
    """One query per row, GQA over pages (see ``kvwire_kernels.reference.paged_decode_attention``).

    A row is a sequence's block table plus the query's context length, so several queries of
    one sequence (a speculative verification) are several rows sharing a table, in one call."""
    return _impl(q).paged_decode_attention(q, k_pages, v_pages, k_scale, v_scale, block_tables,
                                           context_lens, window, sm_scale)
