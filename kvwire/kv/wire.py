"""KV pages on the wire: split a layer's pages into verifiable chunks, and check them on arrival.

Proto-free on purpose: the servers map ``KVChunk`` to and from ``kvwire.v1.KVChunk``. Nothing
received is ever unpickled: bytes plus the spec's dtype and shape, with shape x itemsize checked
against the byte count before a tensor is built, and a CRC-32 over the chunk's bytes.
"""
from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvwire.kv.spec import KVPageSpec

MAX_CHUNK_BYTES = 1 << 20  # 1 MiB: well under gRPC's 4 MiB default message size


class WireError(Exception):
    """A chunk that must not be used (wrong size, wrong place, failed checksum, NaN/inf/out-of-range numbers)."""


@dataclass(frozen=True)
class KVChunk:
    layer: int
    first_page: int  # index of the first page within the sequence (not a pool page id)
    num_pages: int
    k: bytes  # [num_pages, num_kv_heads, block_size, head_dim] values
    v: bytes
    k_scales: bytes  # [num_pages, num_kv_heads, block_size] bfloat16 little-endian; empty for bf16 pages
    v_scales: bytes
    crc32: int

    @property
    def nbytes(self) -> int:
        return len(self.k) + len(self.v) + len(self.k_scales) + len(self.v_scales)


def checksum(k: bytes, v: bytes, ks: bytes, vs: bytes) -> int:
    return zlib.crc32(vs, zlib.crc32(ks, zlib.crc32(v, zlib.crc32(k))))


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()  # little-endian on every target we run on


def pages_per_chunk(spec: KVPageSpec, max_bytes: int = MAX_CHUNK_BYTES) -> int:
    return max(1, max_bytes // spec.page_bytes_per_layer)


def encode_layer(spec: KVPageSpec, layer: int, k: torch.Tensor, v: torch.Tensor,
                 k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                 max_bytes: int = MAX_CHUNK_BYTES) -> Iterator[KVChunk]:
    """k, v: [num_pages, num_kv_heads, block_size, head_dim] of one sequence and one layer, in page
    order; scales [num_pages, num_kv_heads, block_size] bfloat16 (None for bf16 pages): the
    in-memory bytes, unchanged."""
    step = pages_per_chunk(spec, max_bytes)
    for first in range(0, k.shape[0], step):
        sl = slice(first, first + step)
        kb, vb = _raw(k[sl]), _raw(v[sl])
        ksb = _raw(k_scale[sl]) if spec.has_scales else b""
        vsb = _raw(v_scale[sl]) if spec.has_scales else b""
        yield KVChunk(layer, first, k[sl].shape[0], kb, vb, ksb, vsb, checksum(kb, vb, ksb, vsb))


@dataclass(frozen=True)
class DecodedChunk:
    layer: int
    first_page: int
    k: torch.Tensor  # [num_pages, num_kv_heads, block_size, head_dim], the spec's page dtype
    v: torch.Tensor
    k_scale: torch.Tensor | None  # [num_pages, num_kv_heads, block_size] bfloat16
    v_scale: torch.Tensor | None


def decode_chunk(spec: KVPageSpec, chunk: KVChunk, num_seq_pages: int) -> DecodedChunk:
    """Verify a chunk whole (place, sizes, checksum), view its bytes as tensors and refuse numbers no
    sane model computes (``bad_numbers``: NaN, inf, out of range) before anything is imported."""
    if not 0 <= chunk.layer < spec.num_layers:
        raise WireError(f"chunk for layer {chunk.layer}, but the model has {spec.num_layers} layers")
    if chunk.num_pages <= 0 or chunk.first_page < 0 or chunk.first_page + chunk.num_pages > num_seq_pages:
        raise WireError(f"layer {chunk.layer}: pages [{chunk.first_page}, {chunk.first_page + chunk.num_pages}) "
                        f"outside the sequence's {num_seq_pages} pages")
    want = chunk.num_pages * spec.values_per_page * spec.itemsize
    want_scales = chunk.num_pages * spec.scale_bytes_per_page
    for name, got, expected in (("k", len(chunk.k), want), ("v", len(chunk.v), want),
                                ("k_scales", len(chunk.k_scales), want_scales),
                                ("v_scales", len(chunk.v_scales), want_scales)):
        if got != expected:
            raise WireError(f"layer {chunk.layer} pages from {chunk.first_page}: {name} has {got} bytes, "
                            f"expected {expected} for {chunk.num_pages} pages of {spec.dtype.value}")
    if checksum(chunk.k, chunk.v, chunk.k_scales, chunk.v_scales) != chunk.crc32:
        raise WireError(f"layer {chunk.layer} pages from {chunk.first_page}: checksum mismatch")
    shape = (chunk.num_pages, spec.num_kv_heads, spec.block_size, spec.head_dim)
    dtype = torch.float8_e4m3fn if spec.has_scales else torch.bfloat16

    def values(b: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(b), dtype=torch.uint8).view(dtype).view(shape)

    def scales(b: bytes) -> torch.Tensor | None:
        if not spec.has_scales:
            return None
        return torch.frombuffer(bytearray(b), dtype=torch.bfloat16).view(chunk.num_pages, spec.num_kv_heads,
                                                                         spec.block_size)

    decoded = DecodedChunk(chunk.layer, chunk.first_page, values(chunk.k), values(chunk.v),
                           scales(chunk.k_scales), scales(chunk.v_scales))
    bad = bad_numbers(decoded)
    if bad:
        raise WireError(f"layer {chunk.layer} pages from {chunk.first_page}: {bad} (the checksum only says the "
                        "bytes arrived as sent: the sender computed them wrong)")
    return decoded


# Bounds on what a peer's pages may hold. A K or V value beyond +-MAX_KV_ABS (what fp16 could
# hold, roughly; real models stay within the hundreds: SmolLM2-135M's reach ~21) cannot come from a
# sane model, and a finite but huge one overflows attention into NaN logits, which would fail every
# request of the decode step. On the raw bits, so NaN and inf fall out of the same comparison:
# for a bf16 x, |x| > limit <=> (bits & 0x7FFF) > bits(limit) (inf 0x7F80, NaN above).
MAX_KV_ABS = 65536.0
_FP8_NAN = 0x7F  # e4m3fn has no infinity; NaN is S.1111.111 (0x7F / 0xFF); finite values are <= 448
_FP8_MAX = 448.0
_MAGNITUDE, _SIGN = 0x7FFF, -0x8000


def _bf16_bits(x: float) -> int:
    return int(torch.tensor(x, dtype=torch.bfloat16).view(torch.int16))


_VALUE_LIMIT_BITS = _bf16_bits(MAX_KV_ABS)
MAX_KV_SCALE = float(torch.tensor(MAX_KV_ABS / _FP8_MAX, dtype=torch.bfloat16))  # 146: 448 x 146 < 65536
_SCALE_LIMIT_BITS = _bf16_bits(MAX_KV_SCALE)


def _lanes(lane: int, width: int) -> int:
    """``lane`` repeated in every ``width``-bit lane of a 64-bit word, as a signed int64."""
    word = sum(lane << i for i in range(0, 64, width))
    return word - (1 << 64) if word >= 1 << 63 else word


# Any lane over a bound in one pass over 64-bit words (SWAR): with m = lane & low_mask (< 2^(w-1)),
# m > limit <=> m + (low_mask - limit) carries into the lane's top bit; never across lanes.
_FP8_LOW, _FP8_ADD, _FP8_TOP = _lanes(0x7F, 8), _lanes(0x7F - (_FP8_NAN - 1), 8), _lanes(0x80, 8)
_BF16_LOW, _BF16_ADD, _BF16_TOP = _lanes(_MAGNITUDE, 16), _lanes(_MAGNITUDE - _VALUE_LIMIT_BITS, 16), _lanes(0x8000, 16)


def _any_over(t: torch.Tensor, low: int, add: int, top: int) -> bool:
    words = t.view(torch.int64)
    return bool((((words & low) + add) & top).any())


def _over_count(t: torch.Tensor) -> int:
    if t.dtype == torch.float8_e4m3fn:
        return int(((t.view(torch.uint8) & _FP8_NAN) == _FP8_NAN).sum())
    return int(((t.view(torch.int16) & _MAGNITUDE) > _VALUE_LIMIT_BITS).sum())


def bad_numbers(c: DecodedChunk) -> str:
    """What is wrong with a chunk's numbers ('' when nothing): values NaN, infinite or beyond
    +-MAX_KV_ABS; scales NaN, infinite, negative (-0.0 is fine) or over MAX_KV_SCALE. Integer ops
    on the raw bits, 64 bits at a time: about a millisecond for a 1 MiB chunk on one slow core."""
    for name, t in (("k", c.k), ("v", c.v)):
        flat = t.reshape(-1)
        if flat.numel() * flat.element_size() % 8 == 0:
            consts = (_FP8_LOW, _FP8_ADD, _FP8_TOP) if t.dtype == torch.float8_e4m3fn else \
                (_BF16_LOW, _BF16_ADD, _BF16_TOP)
            bad = _any_over(flat, *consts)
        else:
            bad = _over_count(flat) > 0
        if bad:
            return f"{name} holds {_over_count(flat)} values that are NaN, infinite or beyond +-{MAX_KV_ABS:g}"
    for name, t in (("k_scales", c.k_scale), ("v_scales", c.v_scale)):
        if t is None:
            continue
        bits = t.view(torch.int16)
        bad = ((bits & _MAGNITUDE) > _SCALE_LIMIT_BITS) | ((bits < 0) & (bits != _SIGN))  # sign set: not -0.0
        if bool(bad.any()):
            return (f"{name} holds {int(bad.sum())} scales that are NaN, infinite, negative or over "
                    f"{MAX_KV_SCALE:g}")
    return ""


class TransferTracker:
    """Which (layer, page) pairs of one sequence arrived verified: a transfer is complete only when all did."""

    def __init__(self, spec: KVPageSpec, num_pages: int):
        self.spec, self.num_pages = spec, num_pages
        self._seen = [[False] * num_pages for _ in range(spec.num_layers)]
        self.bytes = 0
        self.chunks = 0

    def record(self, chunk: KVChunk) -> None:
        row = self._seen[chunk.layer]
        span = range(chunk.first_page, chunk.first_page + chunk.num_pages)
        if any(row[i] for i in span):
            raise WireError(f"layer {chunk.layer}: pages from {chunk.first_page} arrived twice")
        for i in span:
            row[i] = True
        self.bytes += chunk.nbytes
        self.chunks += 1

    def missing(self) -> list[tuple[int, int]]:
        return [(layer, p) for layer, row in enumerate(self._seen) for p, ok in enumerate(row) if not ok]
