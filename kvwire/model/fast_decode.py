"""The decode step in two C calls (``kvwire_kernels/cpu``): all layers, then the final norm's LM head;
a prefill step's layers in one.

For decode and speculative-verification steps (every token after context in the paged cache), where
eager PyTorch's thirty small ops per layer cost more than a small model's arithmetic. The math is
``kvwire.model.model``'s on weights as stored and FP8 pages read in place; activations are fp32
except into int8 layers on AVX512-VNNI and bf16 layers on AVX512-BF16 CPUs (see
docs/decisions/043-fused-decode-activations.md). K/V bytes are ``reference.write_kv``'s bit for bit,
each row's result is independent of the step's other rows; anything else returns None (model forward).

Prefill steps (``PagedKVCache.prepare(prefill=...)``: prompt chunks, maybe after decode rows) take
``kvw_prefill_layers`` where every layer is a GEMM whose rows are independent (packed int8, GGUF
blocks) and head_dim is at most 64 (where the eager path always takes the same attention kernel):
the same ops with the row ops split between threads, so a row's bits never depend on the step's
other rows (a decode row's are a decode step's); the final norm and LM head are the decode step's.
A cache with ``after_layer`` (prefill_svc's, which streams each layer's pages) is called after every
layer. Where the conditions fail (or with ``KVWIRE_PREFILL_LAYERS=0``), every
prefill step runs the model forward.
"""
from __future__ import annotations

import ctypes

import torch

from kvwire import envs
from kvwire_kernels import cpu
from kvwire.model.gguf_linear import GGUFLinear, GGUFRows
from kvwire.model.linear import Linear
from kvwire.model.model import rope_cos_sin


def linear_desc(module: torch.nn.Module, keep: list) -> cpu.LinearDesc | None:
    """A Linear, Int8Linear, Fp8Linear, GGUFLinear or GGUFRows on CPU as the C side reads it (by the
    tensors it holds), or None for anything else. Tensors (and arrays) whose pointers are taken are
    appended to ``keep``."""
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    if isinstance(module, GGUFLinear):  # GGUF blocks as stored (kvw_gemm_q4_0 / q4_1 / q8_0)
        keep.extend(t for t in (module.packed, module.bias) if t is not None)
        return cpu.LinearDesc(module.packed.data_ptr(), None, ptr(module.bias), module.in_features,
                              module.out_features, cpu.WT_GGUF[module.qtype])
    if isinstance(module, GGUFRows):  # parts of different GGUF types, outputs side by side
        parts = (cpu.LinearDesc * (len(module.parts) + 1))(*[linear_desc(p, keep) for p in module.parts])
        keep.extend([parts] + ([module.bias] if module.bias is not None else []))
        return cpu.LinearDesc(ctypes.addressof(parts), None, ptr(module.bias), module.in_features,
                              module.out_features, cpu.WT_ROWS)
    packed = getattr(module, "packed", None)
    if isinstance(packed, torch.Tensor) and packed.device.type == "cpu" and packed.is_contiguous():
        # int8 weights in kvw_gemm_i8a8's layout (kvwire.model.quant.vnni_layout): int8 activations
        keep.extend(t for t in (packed, module.scale, module.bias) if t is not None)
        return cpu.LinearDesc(packed.data_ptr(), ptr(module.scale), ptr(module.bias), module.in_features,
                              module.out_features, cpu.WT_I8A8_PACKED)
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.device.type != "cpu" or w.dtype not in cpu.WEIGHT_TYPES \
            or w.dim() != 2 or not w.is_contiguous():
        return None
    scale = getattr(module, "scale", None)
    if not isinstance(module, Linear) and not isinstance(scale, torch.Tensor):
        return None  # an unknown layer kind: do not guess its numerics
    bias = getattr(module, "bias", None)
    tensors = [w.detach()] + [None if t is None else t.detach().float().contiguous() for t in (scale, bias)]
    keep.extend(t for t in tensors if t is not None)
    wt = cpu.WEIGHT_TYPES[w.dtype]
    if w.dtype == torch.int8 and scale is not None and w.shape[1] % 64 == 0 and cpu.int8_activations():
        wt = cpu.WT_I8A8  # int8 x int8 (VNNI), activations per block of 32 (see kvwire_kernels/cpu.py)
    elif w.dtype == torch.bfloat16 and w.shape[1] % 32 == 0 and cpu.bf16_activations():
        wt = cpu.WT_BF16A16  # bf16 x bf16 (AVX512-BF16), activations rounded once per call
    return cpu.LinearDesc(ptr(tensors[0]), ptr(tensors[1]), ptr(tensors[2]), w.shape[1], w.shape[0], wt)


class FastDecode:
    """Built once per model (``build``); called by ``Transformer.forward`` for every step."""

    def __init__(self, lib, model, layers: ctypes.Array, head: cpu.LinearDesc, keep: list):
        cfg = model.cfg
        self.lib, self.model, self.layers, self.head = lib, model, layers, head
        self._keep = keep  # the tensors whose pointers the descriptors hold
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.hidden, self.inter, self.eps = cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps
        self.final_norm = model.norm.weight.detach().float().contiguous()
        self.vocab = head.out_features
        kinds = {cpu.WT_I8A8_PACKED, *cpu.WT_GGUF.values()}  # GEMMs whose rows are independent, fast at many rows
        rows_ok = all(_row_kernel(getattr(layer, n), kinds) for layer in layers for n in ("qkv", "o", "gate_up", "down"))
        self.prefill = rows_ok and cfg.head_dim <= PREFILL_MAX_HEAD_DIM and not envs.switched_off("KVWIRE_PREFILL_LAYERS") \
            and cpu.supports_prefill_attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self._head_fn = {cpu.WT_I8A8: lib.kvw_linear_i8a8, cpu.WT_I8A8_PACKED: lib.kvw_gemm_i8a8,
                         cpu.WT_BF16A16: lib.kvw_linear_bf16a16,
                         **{wt: getattr(lib, f"kvw_gemm_{q.lower()}") for q, wt in cpu.WT_GGUF.items()}}.get(head.wt) or \
            getattr(lib, cpu.LINEAR_FN[model.lm_head.weight.dtype])

    @classmethod
    def build(cls, model) -> "FastDecode | None":
        lib = cpu.library()
        cfg = model.cfg
        if lib is None or not cpu.supports_attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim):
            return None
        keep: list[torch.Tensor] = []
        layers = (cpu.LayerDesc * len(model.layers))()
        for desc, block in zip(layers, model.layers):
            lins = [linear_desc(m, keep) for m in (block.attn.qkv, block.attn.o, block.mlp.gate_up, block.mlp.down)]
            if any(d is None for d in lins):
                return None
            norms = [block.attn_norm.weight.detach().float().contiguous(), block.mlp_norm.weight.detach().float().contiguous()]
            keep.extend(norms)
            desc.attn_norm, desc.mlp_norm = norms[0].data_ptr(), norms[1].data_ptr()
            desc.qkv, desc.o, desc.gate_up, desc.down = lins
            desc.window = block.attn.window or 0
        head = linear_desc(model.lm_head, keep)
        return None if head is None else cls(lib, model, layers, head, keep)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache,
                 logits_rows: torch.Tensor | None) -> torch.Tensor | None:
        step = getattr(cache, "paged_step", None)
        step = step() if step is not None else None
        if step is None and self.prefill and tokens.device.type == "cpu":
            segments = getattr(cache, "prefill_segments", None)
            segments = segments() if segments is not None else None
            if segments is not None:
                return self._prefill(tokens, positions, cache, logits_rows, *segments)
        if step is None or tokens.device.type != "cpu":
            return None
        slots, tables, ctx = step
        n, threads, d = tokens.shape[0], torch.get_num_threads(), self.d
        x = self.model.embed(tokens).float().contiguous()  # [n, hidden], updated in place layer by layer
        cos, sin = (t.reshape(n, d).contiguous() for t in rope_cos_sin(self.model.inv_freq, positions))  # [n, d]
        fp8 = cache.k_scale is not None
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        self.lib.kvw_decode_layers(
            self.layers, len(self.layers), x.data_ptr(), n, self.hidden, self.h, self.hkv, d, self.inter, self.eps,
            cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1], ctx.data_ptr(),
            cache.k.data_ptr(), cache.v.data_ptr(), ptr(cache.k_scale), ptr(cache.v_scale),
            cache.k[0].numel(), 0 if cache.k_scale is None else cache.k_scale[0].numel(), cache.spec.block_size,
            int(fp8), cache.sm_scale, threads)
        return self._head(x, logits_rows)

    def _head(self, x: torch.Tensor, logits_rows: torch.Tensor | None) -> torch.Tensor:
        """The final norm and LM head in C over x [n, hidden] (the rows ``logits_rows`` only, if given):
        every step's rows, decode or prompt, so a row's logits never depend on the step's kind."""
        if logits_rows is not None:
            x = x[logits_rows]
        x = x.contiguous()  # [num_rows, hidden]
        rows = x.shape[0]
        normed = torch.empty(rows, self.hidden)
        self.lib.kvw_rms_norm(x.data_ptr(), rows, self.hidden, self.final_norm.data_ptr(), self.eps, normed.data_ptr())
        self.model.last_hidden = normed  # [num_rows, hidden] (kvwire.model.draft_head)
        logits = torch.empty(rows, self.vocab)
        hd = self.head
        self._head_fn(normed.data_ptr(), rows, hd.in_features, hd.w, self.vocab, logits.data_ptr(), hd.scale,
                      hd.bias, None, torch.get_num_threads())
        return logits  # [num_rows, vocab] fp32

    def _prefill(self, tokens: torch.Tensor, positions: torch.Tensor, cache, logits_rows: torch.Tensor | None,
                 slots: torch.Tensor, segments: torch.Tensor, tables: torch.Tensor,
                 decode: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """A prefill step: the layers in C (``kvw_prefill_layers``), then the model's final norm and LM head.
        segments: [S, 3] int64 (first row, rows, start position); tables: [S, max_blocks] int32; decode:
        the rows before the segments' (block tables [R, max_blocks] int32, context lengths [R] int32) or None."""
        n, d = tokens.shape[0], self.d
        x = self.model.embed(tokens).float().contiguous()  # [n, hidden], updated in place layer by layer
        cos, sin = (t.reshape(n, d).contiguous() for t in rope_cos_sin(self.model.inv_freq, positions))  # [n, d]
        seg = segments.t().contiguous()  # [3, S]: first rows, lengths, starts
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        hook, raised = getattr(cache, "after_layer", None), []

        def after_layer(layer: int) -> int:  # an exception cannot cross C: kept, raised once C returns
            try:
                return hook(layer)
            except BaseException as e:  # noqa: BLE001
                raised.append(e)
                return 0
        callback = cpu.LAYER_CALLBACK(after_layer) if hook is not None else None
        self.lib.kvw_prefill_layers(
            self.layers, len(self.layers), x.data_ptr(), n, self.hidden, self.h, self.hkv, d, self.inter, self.eps,
            cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), seg.shape[1], seg[0].data_ptr(), seg[1].data_ptr(),
            seg[2].data_ptr(), tables.data_ptr(), tables.shape[1], cache.k.data_ptr(), cache.v.data_ptr(),
            ptr(cache.k_scale), ptr(cache.v_scale), cache.k[0].numel(),
            0 if cache.k_scale is None else cache.k_scale[0].numel(), cache.spec.block_size,
            int(cache.k_scale is not None), cache.sm_scale, torch.get_num_threads(), callback,
            0 if decode is None else decode[1].shape[0], ptr(None if decode is None else decode[0]),
            0 if decode is None else decode[0].shape[1], ptr(None if decode is None else decode[1]))
        if raised:
            raise raised[0]
        return self._head(x, logits_rows)


PREFILL_MAX_HEAD_DIM = 64  # the eager path's attention is kvw_prefill_attention at any length up to here (kv.tuned)


def _row_kernel(desc: cpu.LinearDesc, kinds: set[int]) -> bool:
    """Whether a layer descriptor runs on GEMMs of ``kinds`` only (parts of a WT_ROWS layer included)."""
    if desc.wt == cpu.WT_ROWS:
        parts = ctypes.cast(desc.w, ctypes.POINTER(cpu.LinearDesc))
        i, ok = 0, True
        while parts[i].out_features:
            ok, i = ok and parts[i].wt in kinds, i + 1
        return ok
    return desc.wt in kinds
