"""KV wire codec: chunks stay under 1 MiB, round-trip exactly, and anything damaged is refused;
a peer that sends another page format is refused with a readable diff."""
from __future__ import annotations

import contextlib
import dataclasses

import grpc
import pytest
import torch

from kvwire.config import KVDtype
from kvwire.kv.spec import KVPageSpec, ScaleDtype, ScaleGranularity
from kvwire.kv.wire import MAX_CHUNK_BYTES, TransferTracker, WireError, decode_chunk, encode_layer
from kvwire.runtime import EngineConfig
from protos import convert as conv
from protos.kvwire.v1 import kvwire_pb2 as pb
from tests.decode_svc.harness import Harness, tiny_model


def pages(spec: KVPageSpec, n: int):
    g = torch.Generator().manual_seed(0)
    shape = (n, spec.num_kv_heads, spec.block_size, spec.head_dim)
    if spec.has_scales:
        k = (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        v = (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        sshape = (n, spec.num_kv_heads, spec.block_size)
        return (k, v, torch.rand(sshape, generator=g).bfloat16(), torch.rand(sshape, generator=g).bfloat16())
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


@pytest.mark.parametrize("head_dim, ratio", [(64, 66 / 128), (128, 130 / 256), (32, 34 / 64)])
def test_fp8_pages_with_scales_vs_bf16(head_dim, ratio):
    """One bf16 scale per (token, kv-head) for head_dim values: (head_dim + 2) / (2 head_dim):
    within 0.52x from head_dim 64 up; head_dim 32 (the embedded model) gives 0.531x."""
    fp8 = KVPageSpec(16, 30, 3, head_dim, KVDtype.FP8_E4M3)
    bf16 = dataclasses.replace(fp8, dtype=KVDtype.BF16)
    assert fp8.bytes_per_token / bf16.bytes_per_token == pytest.approx(ratio)
    assert ratio <= 0.52 or head_dim < 64
    assert fp8.page_bytes_per_layer == 2 * 3 * 16 * (head_dim + 2)
    k, v, ks, vs = pages(fp8, 2)
    chunk = next(encode_layer(fp8, 0, k, v, ks, vs))
    assert chunk.nbytes == 2 * fp8.page_bytes_per_layer  # the wire carries exactly the page bytes


def test_damage_is_refused():
    spec = KVPageSpec(block_size=16, num_layers=2, num_kv_heads=2, head_dim=16)
    k, v, ks, vs = pages(spec, 3)
    chunk = next(encode_layer(spec, 0, k, v, ks, vs))
    flipped = bytearray(chunk.k)
    flipped[5] ^= 1
    with pytest.raises(WireError, match="checksum"):
        decode_chunk(spec, dataclasses.replace(chunk, k=bytes(flipped)), 3)
    flipped = bytearray(chunk.v_scales)
    flipped[-1] ^= 0x80
    with pytest.raises(WireError, match="checksum"):
        decode_chunk(spec, dataclasses.replace(chunk, v_scales=bytes(flipped)), 3)
    with pytest.raises(WireError, match="k_scales has 24 bytes, expected 192"):  # format 1's float32 per (page, head)
        decode_chunk(spec, dataclasses.replace(chunk, k_scales=chunk.k_scales[:24]), 3)
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


FORMAT_1 = dict(scale_granularity=ScaleGranularity.PER_PAGE_HEAD, scale_dtype=ScaleDtype.FLOAT32, format_version=1)


def test_spec_round_trips_and_unset_fields_read_as_format_1():
    spec = KVPageSpec(16, 3, 2, 16)
    assert conv.spec_from_pb(conv.spec_to_pb(spec)) == spec
    old = pb.KVPageSpec(block_size=16, num_layers=3, num_kv_heads=2, head_dim=16, dtype=pb.KVPageSpec.KV_DTYPE_FP8_E4M3,
                        scale_granularity=pb.KVPageSpec.SCALE_GRANULARITY_PER_PAGE_HEAD)  # what format 1 sent
    assert conv.spec_from_pb(old) == dataclasses.replace(spec, **FORMAT_1)
    assert spec.diff(conv.spec_from_pb(old)) == ["scale_granularity: 'per_token_head' != 'per_page_head'",
                                                 "scale_dtype: 'bf16' != 'float32'", "format_version: 2 != 1"]


class Format1Prefill:
    """The real PrefillServicer, but its stream header says format 1, as a not yet upgraded
    prefill_svc would."""

    def __init__(self, inner):
        self.inner = inner

    async def Prefill(self, request, context):
        async with contextlib.aclosing(self.inner.Prefill(request, context)) as stream:
            async for msg in stream:
                if msg.WhichOneof("kind") == "header":
                    spec = conv.spec_from_pb(msg.header.spec)
                    msg.header.spec.CopyFrom(conv.spec_to_pb(dataclasses.replace(spec, **FORMAT_1)))
                yield msg


async def test_format_1_peer_is_failed_precondition_with_diff(tmp_path):
    cfg = EngineConfig(model_dir=tiny_model(tmp_path / "tiny"), num_pages=128)
    async with Harness(cfg, prefill_wrapper=Format1Prefill) as h:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await h.generate(list(range(5, 40)), kv_source=pb.KV_SOURCE_REMOTE)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
        assert "format_version: 2 != 1" in e.value.details(), e.value.details()
        assert "scale_granularity: 'per_token_head' != 'per_page_head'" in e.value.details()
        assert await h.pools_back_to(64, 128)
