"""KV wire codec: chunks stay under 1 MiB, round-trip exactly, and anything damaged is refused."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvwire.config import KVDtype
from kvwire.kv.spec import KVPageSpec
from kvwire.kv.wire import MAX_CHUNK_BYTES, TransferTracker, WireError, decode_chunk, encode_layer


def pages(spec: KVPageSpec, n: int):
    g = torch.Generator().manual_seed(0)
    shape = (n, spec.num_kv_heads, spec.block_size, spec.head_dim)
    if spec.has_scales:
        k = (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        v = (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        return k, v, torch.rand(n, spec.num_kv_heads, generator=g), torch.rand(n, spec.num_kv_heads, generator=g)
    return torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16(), None, None


@pytest.mark.parametrize("dtype", [KVDtype.FP8_E4M3, KVDtype.BF16])
def test_round_trip_and_chunk_size(dtype):
    spec = KVPageSpec(block_size=32, num_layers=2, num_kv_heads=8, head_dim=128, dtype=dtype)
    n = 70
    k, v, ks, vs = pages(spec, n)
    chunks = list(encode_layer(spec, 1, k, v, ks, vs))
    assert len(chunks) > 1 and all(c.nbytes <= MAX_CHUNK_BYTES for c in chunks)
    tracker = TransferTracker(spec, n)
    for c in chunks:
        d = decode_chunk(spec, c, n)
        sl = slice(d.first_page, d.first_page + c.num_pages)
        assert torch.equal(d.k.view(torch.uint8), k[sl].view(torch.uint8))
        assert torch.equal(d.v.view(torch.uint8), v[sl].view(torch.uint8))
        if spec.has_scales:
            assert torch.equal(d.k_scale, ks[sl]) and torch.equal(d.v_scale, vs[sl])
        tracker.record(c)
    assert tracker.missing() == [(0, p) for p in range(n)]  # layer 0 never sent


def test_fp8_pages_are_about_half_of_bf16():
    fp8 = KVPageSpec(16, 22, 4, 64, KVDtype.FP8_E4M3)
    bf16 = dataclasses.replace(fp8, dtype=KVDtype.BF16)
    assert fp8.bytes_per_token / bf16.bytes_per_token <= 0.53


def test_damage_is_refused():
    spec = KVPageSpec(block_size=16, num_layers=2, num_kv_heads=2, head_dim=16)
    k, v, ks, vs = pages(spec, 3)
    chunk = next(encode_layer(spec, 0, k, v, ks, vs))
    flipped = bytearray(chunk.k)
    flipped[5] ^= 1
    with pytest.raises(WireError, match="checksum"):
        decode_chunk(spec, dataclasses.replace(chunk, k=bytes(flipped)), 3)
    with pytest.raises(WireError, match="v has .* bytes, expected"):
        decode_chunk(spec, dataclasses.replace(chunk, v=chunk.v[:-1]), 3)
    with pytest.raises(WireError, match="layer 5"):
        decode_chunk(spec, dataclasses.replace(chunk, layer=5), 3)
    with pytest.raises(WireError, match="outside the sequence"):
        decode_chunk(spec, chunk, 2)
    tracker = TransferTracker(spec, 3)
    tracker.record(chunk)
    with pytest.raises(WireError, match="twice"):
        tracker.record(chunk)
