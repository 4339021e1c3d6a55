"""One bad request or peer never hurts another: each poison case, sent while 4 healthy requests are
being decoded, ends that request alone with its code; the 4 give exactly the tokens they give
alone and both pools return to their baseline. Over real loopback gRPC (decode + a faulty prefill:
the real PrefillServicer, its stream damaged for the marked prompt under a valid CRC-32)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path

import grpc
import pytest
import torch

from kvwire.config import KVDtype
from kvwire.kv.wire import KVChunk, WireError, checksum, decode_chunk, encode_layer
from kvwire.runtime import EngineConfig, load_engine
from protos.kvwire.v1 import kvwire_pb2 as pb
from tests.decode_svc.harness import Harness, tiny_model

VOCAB = 300
MARK = 299  # a poisoned prompt starts with this token
HEALTHY = [([5 + i, 17, 42 + i, 9] * 5, dict(max_tokens=120) if i % 2 else
            dict(max_tokens=120, temperature=0.8, top_k=40, seed=i)) for i in range(4)]
POISON_PROMPT = [MARK] + list(range(10, 49))  # 40 tokens: 3 pages per layer


def _bf16_bits(data: bytes, value: int, every: int = 97) -> bytes:
    """``data`` (bf16 little-endian) with one value in ``every`` replaced by the bf16 bit pattern ``value``."""
    out = bytearray(data)
    for off in range(0, len(out) - 1, 2 * every):
        out[off:off + 2] = value.to_bytes(2, "little")
    return bytes(out)


def _poison_values(data: bytes, fp8: bool) -> bytes:
    if fp8:  # e4m3fn NaN is S.1111.111
        out = bytearray(data)
        out[len(out) // 3] = 0x7F
        out[len(out) // 2] = 0xFF
        return bytes(out)
    return _bf16_bits(data, 0x7FC0)  # bf16 NaN


POISONS = {  # case -> (damage to the first chunk's fields, or to the final message)
    "nan_values": lambda c, fp8: dataclasses.replace(c, k=_poison_values(c.k, fp8)),
    "inf_scale": lambda c, fp8: dataclasses.replace(c, v_scales=_bf16_bits(c.v_scales, 0x7F80)),
    "negative_scale": lambda c, fp8: dataclasses.replace(c, k_scales=_bf16_bits(c.k_scales, 0xBF80)),  # -1.0
    "inf_bf16_values": lambda c, fp8: dataclasses.replace(c, v=_bf16_bits(c.v, 0xFF80)),  # -inf
    # Finite, but no sane model's: overflows attention into NaN logits (the whole step would fail).
    "huge_scale": lambda c, fp8: dataclasses.replace(c, k_scales=_bf16_bits(c.k_scales, 0x7F7F, every=1)),
    "huge_bf16_values": lambda c, fp8: dataclasses.replace(c, k=_bf16_bits(c.k, 0x7F7F, every=1)),  # 3.4e38
}


class PoisoningPrefill:
    """The real PrefillServicer; for a prompt starting with MARK it damages the stream as ``case``
    says, re-computing the CRC so that only the numbers are wrong."""

    def __init__(self, inner, case: str, fp8: bool):
        self.inner, self.case, self.fp8 = inner, case, fp8

    async def Prefill(self, request, context):
        poisoned = bool(request.token_ids) and request.token_ids[0] == MARK
        damaged = False
        async with contextlib.aclosing(self.inner.Prefill(request, context)) as stream:
            async for msg in stream:
                kind = msg.WhichOneof("kind")
                if poisoned and kind == "chunk" and not damaged and self.case in POISONS:
                    c = POISONS[self.case](_chunk(msg.chunk), self.fp8)
                    c = dataclasses.replace(c, crc32=checksum(c.k, c.v, c.k_scales, c.v_scales))
                    msg = pb.PrefillResponse(chunk=pb.KVChunk(
                        layer=c.layer, first_page=c.first_page, num_pages=c.num_pages, k_values=c.k,
                        v_values=c.v, k_scales=c.k_scales, v_scales=c.v_scales, crc32=c.crc32))
                    damaged = True
                if poisoned and kind == "done" and self.case == "first_token":
                    msg.done.first_token = VOCAB + 7
                yield msg


def _chunk(m: pb.KVChunk) -> KVChunk:
    return KVChunk(m.layer, m.first_page, m.num_pages, m.k_values, m.v_values, m.k_scales, m.v_scales, m.crc32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny"), vocab_size=VOCAB)


BAD_VALUES, BAD_SCALES = "values that are NaN, infinite or beyond", "scales that are NaN, infinite, negative or over"
CASES = [("first_token", KVDtype.FP8_E4M3, grpc.StatusCode.DATA_LOSS, "outside the vocabulary"),
         ("nan_values", KVDtype.FP8_E4M3, grpc.StatusCode.DATA_LOSS, BAD_VALUES),
         ("inf_scale", KVDtype.FP8_E4M3, grpc.StatusCode.DATA_LOSS, BAD_SCALES),
         ("negative_scale", KVDtype.FP8_E4M3, grpc.StatusCode.DATA_LOSS, BAD_SCALES),
         ("huge_scale", KVDtype.FP8_E4M3, grpc.StatusCode.DATA_LOSS, BAD_SCALES),
         ("nan_values", KVDtype.BF16, grpc.StatusCode.DATA_LOSS, BAD_VALUES),
         ("inf_bf16_values", KVDtype.BF16, grpc.StatusCode.DATA_LOSS, BAD_VALUES),
         ("huge_bf16_values", KVDtype.BF16, grpc.StatusCode.DATA_LOSS, BAD_VALUES),
         ("tiny_temperature", KVDtype.FP8_E4M3, grpc.StatusCode.INVALID_ARGUMENT, "temperature")]


@pytest.mark.parametrize("case, kv, code, match", CASES, ids=[f"{c}-{kv.value}" for c, kv, *_ in CASES])
async def test_poison_in_a_batch_of_four_healthy_requests(model_dir, case, kv, code, match):
    cfg = EngineConfig(model_dir=model_dir, num_pages=128, kv_dtype=kv)
    fp8 = kv is KVDtype.FP8_E4M3
    async with Harness(cfg, prefill_wrapper=lambda inner: PoisoningPrefill(inner, case, fp8)) as h:
        alone = [await h.generate(p, **kw) for p, kw in HEALTHY]
        assert await h.pools_back_to(64, 128)

        calls = [h.decode.GenerateTokens(pb.GenerateTokensRequest(prompt_token_ids=p, sampling=pb.SamplingParams(**kw)))
                 for p, kw in HEALTHY]
        firsts = [list((await c.read()).token_ids) for c in calls]  # all four are running now

        async def rest(call) -> list[int]:
            tokens = []
            while (m := await call.read()) is not grpc.aio.EOF:
                tokens += m.token_ids
            return tokens
        healthy = [asyncio.ensure_future(rest(c)) for c in calls]
        sampling = dict(max_tokens=40, temperature=3e-38) if case == "tiny_temperature" else dict(max_tokens=40)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await h.generate(POISON_PROMPT, **sampling)
        assert e.value.code() == code and match in e.value.details(), (e.value.code(), e.value.details())
        assert not any(t.done() for t in healthy), "the poisoned request must meet the healthy ones in decode"
        together = [f + await t for f, t in zip(firsts, healthy)]
        assert together == alone
        assert await h.pools_back_to(64, 128)


# ---- the check itself, on encoded chunks -------------------------------------------------------------

@pytest.fixture(scope="module")
def layer_chunks(model_dir):
    """Every chunk of one real prompt's layer 0, fp8 and bf16 pages."""
    out = {}
    for kv in (KVDtype.FP8_E4M3, KVDtype.BF16):
        rt = load_engine(EngineConfig(model_dir=model_dir, num_pages=16, kv_dtype=kv))
        cache = rt.new_cache(16)
        rt.model(torch.tensor(POISON_PROMPT), cache.prepare([0], [len(POISON_PROMPT)]), cache,
                 logits_rows=torch.tensor([len(POISON_PROMPT) - 1]))
        idx = torch.tensor(cache.page_ids(0))
        k, v, ks, vs = cache.layer_tensors(0)
        pick = lambda t: None if t is None else t.view(torch.uint8)[idx].view(t.dtype)  # noqa: E731
        out[kv] = rt.spec, list(encode_layer(rt.spec, 0, pick(k), pick(v), pick(ks), pick(vs)))
    return out


def test_real_pages_pass_and_each_poison_is_refused_under_a_valid_crc(layer_chunks):
    for kv, (spec, chunks) in layer_chunks.items():
        fp8 = kv is KVDtype.FP8_E4M3
        num_pages = spec.pages_for(len(POISON_PROMPT))
        for c in chunks:
            decode_chunk(spec, c, num_pages)  # real pages: accepted (zeroed tail slots included)
        c = chunks[0]
        names = ["nan_values", "inf_bf16_values", "huge_bf16_values"] if not fp8 else \
            ["nan_values", "inf_scale", "negative_scale", "huge_scale"]
        for name in names:
            bad = POISONS[name](c, fp8)
            bad = dataclasses.replace(bad, crc32=checksum(bad.k, bad.v, bad.k_scales, bad.v_scales))
            with pytest.raises(WireError, match=f"{BAD_VALUES}|{BAD_SCALES}"):
                decode_chunk(spec, bad, num_pages)
        # At the limits, and -0.0 (a sign bit on zero, not a negative scale): accepted.
        edge = {True: [("k_scales", 0x8000), ("v_scales", 0x4312)],  # -0.0, 146.0 = MAX_KV_SCALE
                False: [("k", 0xC780), ("v", 0x4780)]}[fp8]  # -65536, 65536
        for field, bits in edge:
            ok = dataclasses.replace(c, **{field: _bf16_bits(getattr(c, field), bits)})
            decode_chunk(spec, dataclasses.replace(ok, crc32=checksum(ok.k, ok.v, ok.k_scales, ok.v_scales)),
                         num_pages)


@pytest.mark.parametrize("name", ["kvwire-tiny", "smollm2-135m-instruct"])
def test_real_models_pages_stay_far_inside_the_bounds(name):
    """The bounds refuse no real page: K/V magnitudes over a 700-token prompt of real text
    (printed with -s), on every layer (fp8 pages: scale x 448 bounds each value)."""
    from kvwire.config import DEFAULT_MODEL_DIR
    from kvwire.kv.wire import MAX_KV_ABS
    from kvwire.model.registry import cached_path, is_cached
    from kvwire.tokenizer import ModelTokenizer
    if name != "kvwire-tiny" and not is_cached(name):
        pytest.skip(f"{name} is not fetched (python -m tools.fetch_model {name})")
    path = DEFAULT_MODEL_DIR if name == "kvwire-tiny" else cached_path(name)
    text = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    for kv in (KVDtype.FP8_E4M3,):
        rt = load_engine(EngineConfig(model_dir=path, num_pages=64, kv_dtype=kv))
        ids = ModelTokenizer(path).encode(text)[:700]
        cache = rt.new_cache(64)
        rt.model(torch.tensor(ids), cache.prepare([0], [len(ids)]), cache, logits_rows=torch.tensor([len(ids) - 1]))
        idx, most = torch.tensor(cache.page_ids(0)), 0.0
        for layer in range(rt.spec.num_layers):
            k, v, ks, vs = cache.layer_tensors(layer)
            for t in ((ks, vs) if ks is not None else (k, v)):
                most = max(most, float(t[idx].float().abs().max()) * (448 if ks is not None else 1))
        print(f"{name} {kv.value}: largest K/V magnitude {most:.1f} (bound {MAX_KV_ABS:g})")
        assert 0 < most < MAX_KV_ABS / 100
