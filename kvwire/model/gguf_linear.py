"""A linear layer on GGUF blocks as the file stores them (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K): ``--weights gguf``.

Built at load time from a tensor's raw blocks (llama.cpp's Q/K row permutation undone by moving whole
rows, which is exact), repacked once for the C kernel (``kvwire_kernels.cpu.pack_gguf``: every bit
of the file is kept) and never dequantized on the way in. Activations are quantized
per block of 32 as the int8 path's (``reference.quantize_act8``); the block dot products are exact
integers. Linear's contract: fp32 [rows, in] -> fp32 [rows, out]. Without the CPU kernels the
PyTorch reference (``reference.linear_gguf``) computes the same numbers, slowly.

On a CUDA device the layer holds the rows of blocks exactly as the file stores them (moving the
module converts: ``_apply``) and multiplies them with ``kvwire_kernels.triton_gguf.linear``:
activations rounded to bf16, not quantized (W4A16), the weight's integers and fp32 scales exact.
"""
from __future__ import annotations

import torch
from torch import nn

from kvwire_kernels import cpu, dispatch, reference

# GGUF tensor types this layer multiplies as stored (the kernels' formats).
NATIVE_TYPES = tuple(cpu.GGUF_BLOCKS)
ROWS_MULTIPLE = 16  # the kernels' panels of output rows


def native_shape(qtype: str, rows: int, cols: int) -> bool:
    """Whether a [rows, cols] ``qtype`` weight fits the kernels' panels and blocks."""
    return rows % ROWS_MULTIPLE == 0 and cols % cpu.GGUF_BLOCKS[qtype][0] == 0 and rows > 0


class GGUFLinear(nn.Module):
    """GGUF blocks of one type (``qtype``: one of NATIVE_TYPES); see the module docstring."""

    def __init__(self, raw: torch.Tensor, qtype: str, in_features: int):
        # raw: uint8 [out, in / block values * block bytes], the rows of blocks as the file stores them.
        super().__init__()
        if qtype not in NATIVE_TYPES:
            raise ValueError(f"GGUFLinear: type {qtype} is not one of {', '.join(NATIVE_TYPES)}")
        values, size = cpu.GGUF_BLOCKS[qtype]
        if raw.shape[1] != in_features // values * size or not native_shape(qtype, raw.shape[0], in_features):
            raise ValueError(f"GGUFLinear: {qtype} blocks {tuple(raw.shape)} do not hold [{raw.shape[0]}, {in_features}]")
        self.qtype, self.out_features, self.in_features = qtype, raw.shape[0], in_features
        # On the CPU: [out / 16, blocks, packed bytes] uint8 (pack_gguf); elsewhere: raw [out, bytes] uint8.
        self.register_buffer("packed", cpu.pack_gguf(raw.contiguous(), qtype))
        self.register_buffer("bias", None)  # [out] fp32 when the checkpoint has one (set by the loader)

    def raw_blocks(self) -> torch.Tensor:
        """The rows of blocks exactly as the file stores them (Q/K rows in HF order), [out, bytes] uint8."""
        if self.packed.device.type == "cpu":
            return cpu.unpack_gguf(self.packed, self.qtype)
        return self.packed

    def _apply(self, fn, recurse=True):
        # Every move (model.to(device), .cuda(), .cpu()) lands here: the bytes follow the module,
        # then take the layout of their new device, the CPU's panels or the rows as stored; every bit kept.
        was_cpu = self.packed.device.type == "cpu"
        super()._apply(fn, recurse)
        on_cpu = self.packed.device.type == "cpu"
        if was_cpu and not on_cpu:
            self.packed = cpu.unpack_gguf(self.packed, self.qtype)  # torch ops, on the device
        elif on_cpu and not was_cpu:
            self.packed = cpu.pack_gguf(self.packed.contiguous(), self.qtype)
        return self

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] fp32: ``gguf.quants.dequantize``'s values, bit for bit."""
        return reference.dequantize_gguf(self.raw_blocks(), self.qtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] fp32 -> [rows, out] fp32
        if x.device.type != "cpu":  # Triton on CUDA (W4A16), the reference elsewhere
            return dispatch.linear_gguf(x, self.packed, self.qtype, self.bias)
        x = x.float().contiguous()
        if cpu.available():
            return cpu.gemm_gguf(x, self.packed, self.qtype, self.bias)
        return reference.linear_gguf(x, self.raw_blocks(), self.qtype, self.bias)


class GGUFRows(nn.Module):
    """A fused layer (Q, K, V; gate, up) whose parts the file stores in different types (as a Q4_K_M
    file stores V in Q6_K): one ``GGUFLinear`` per run of rows of one type, outputs side by side.
    Rows are independent, so this is the same product as one layer of the concatenated rows."""

    def __init__(self, parts: list[GGUFLinear]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.register_buffer("bias", None)  # [out] fp32 when the checkpoint has one (set by the loader)

    def dequantized_weight(self) -> torch.Tensor:
        return torch.cat([p.dequantized_weight() for p in self.parts])  # [out, in] fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] fp32 -> [rows, out] fp32
        y = torch.cat([p(x) for p in self.parts], dim=1)
        return y if self.bias is None else y + self.bias


class GGUFEmbedding(nn.Module):
    """The token embedding table on the file's blocks (rows of blocks, as stored): a lookup gathers the
    rows of the tokens asked for and dequantizes only those (``gguf.quants.dequantize``'s values, so the
    same fp32 rows as the dequantized table). A Q4_K table of TinyLlama's shape holds 37 MB, not 262 MB."""

    def __init__(self, raw: torch.Tensor, qtype: str, embedding_dim: int):
        # raw: uint8 [vocab, embedding_dim / block values * block bytes]
        super().__init__()
        values, size = cpu.GGUF_BLOCKS[qtype]
        if embedding_dim % values or raw.shape[1] != embedding_dim // values * size:
            raise ValueError(f"GGUFEmbedding: {qtype} blocks {tuple(raw.shape)} do not hold [{raw.shape[0]}, {embedding_dim}]")
        self.qtype, self.num_embeddings, self.embedding_dim = qtype, raw.shape[0], embedding_dim
        self.register_buffer("raw", raw.contiguous())  # [vocab, row bytes] uint8

    def dequantized_weight(self) -> torch.Tensor:
        return reference.dequantize_gguf(self.raw, self.qtype)  # [vocab, hidden] fp32

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: [n] int64 -> [n, hidden] fp32
        return reference.dequantize_gguf(self.raw.index_select(0, tokens.reshape(-1)), self.qtype) \
            .reshape(*tokens.shape, self.embedding_dim)
