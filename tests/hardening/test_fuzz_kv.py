"""Property-based fuzzing of the KV stream decode receives from prefill: a prefill replica that
damages its real stream as hypothesis says (messages dropped, repeated, swapped or cut; header,
spec and chunk fields set to any value; bytes changed or resized, with the CRC-32 recomputed or
not; NaN values; any first token). Over real loopback gRPC, BATCH requests at once: every answer is
OK or DATA_LOSS / FAILED_PRECONDITION, never UNKNOWN or INTERNAL, after every batch both pools are
back at their baseline, and afterwards decode still gives a clean request its tokens."""
from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire.kv.wire import checksum
from kvwire.runtime import EngineConfig
from protos.kvwire.v1 import kvwire_pb2 as pb
from tests.decode_svc.harness import Harness, tiny_model
from tests.hardening.test_fuzz import fuzz

BATCH = 4
EXAMPLES = 60  # 240 streams
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.FAILED_PRECONDITION}
U32 = st.integers(0, 2**32 - 1)
CHUNK_INTS = st.sampled_from(["layer", "first_page", "num_pages", "crc32"])
CHUNK_BYTES = st.sampled_from(["k_values", "v_values", "k_scales", "v_scales"])
AT = st.integers(0, 63)  # a message index, taken modulo the stream's length

OP = st.one_of(
    st.tuples(st.just("drop"), AT), st.tuples(st.just("repeat"), AT), st.tuples(st.just("swap"), AT, AT),
    st.tuples(st.just("cut"), AT),
    st.tuples(st.just("chunk_int"), AT, CHUNK_INTS, st.one_of(st.integers(0, 8), U32)),
    st.tuples(st.just("header_int"), st.sampled_from(["num_tokens", "num_pages", "first_page"]),
              st.one_of(st.integers(0, 64), U32)),
    st.tuples(st.just("spec_int"), st.sampled_from(["block_size", "num_layers", "num_kv_heads", "head_dim",
                                                     "dtype", "scale_granularity", "scale_dtype", "format_version"]),
              st.one_of(st.integers(0, 8), st.integers(0, 2**31 - 1))),
    st.tuples(st.just("byte"), AT, CHUNK_BYTES, st.integers(0, 2**20), st.integers(0, 255), st.booleans()),
    st.tuples(st.just("resize"), AT, CHUNK_BYTES, st.integers(-64, 64), st.booleans()),
    st.tuples(st.just("first_token"), st.one_of(st.integers(0, 400), U32)),
)
PLAN = st.lists(OP, max_size=3)


def _recrc(c: pb.KVChunk) -> None:
    c.crc32 = checksum(c.k_values, c.v_values, c.k_scales, c.v_scales)


def damage(msgs: list[pb.PrefillResponse], plan) -> list[pb.PrefillResponse]:
    msgs = [pb.PrefillResponse.FromString(m.SerializeToString()) for m in msgs]
    for op, *a in plan:
        if not msgs:
            break
        i = a[0] % len(msgs) if a and isinstance(a[0], int) else 0
        kind = msgs[i].WhichOneof("kind")
        if op == "drop":
            del msgs[i]
        elif op == "repeat":
            msgs.insert(i, msgs[i])
        elif op == "swap":
            j = a[1] % len(msgs)
            msgs[i], msgs[j] = msgs[j], msgs[i]
        elif op == "cut":
            del msgs[i:]
        elif op in ("chunk_int", "byte", "resize") and kind == "chunk":
            c = msgs[i].chunk
            if op == "chunk_int":
                setattr(c, a[1], a[2])
            elif op == "byte":
                data = bytearray(getattr(c, a[1]))
                if data:
                    data[a[2] % len(data)] = a[3]
                    setattr(c, a[1], bytes(data))
                    if a[4]:
                        _recrc(c)
            else:
                data = getattr(c, a[1])
                setattr(c, a[1], data[:len(data) + a[2]] if a[2] < 0 else data + b"\x7f" * a[2])
                if a[3]:
                    _recrc(c)
        elif op == "header_int":
            for m in msgs:
                if m.WhichOneof("kind") == "header":
                    setattr(m.header, a[0], a[1])
        elif op == "spec_int":
            for m in msgs:
                if m.WhichOneof("kind") == "header":
                    setattr(m.header.spec, a[0], a[1])
        elif op == "first_token":
            for m in msgs:
                if m.WhichOneof("kind") == "done":
                    m.done.first_token = a[0]
    return msgs


class FuzzPrefill:
    """The real PrefillServicer, its whole stream collected, then damaged by the request's plan."""

    def __init__(self, inner):
        self.inner, self.plans = inner, {}

    async def Prefill(self, request, context):
        msgs = [m async for m in self.inner.Prefill(request, context)]
        for m in damage(msgs, self.plans.pop(request.request_id, [])):
            yield m


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny"))


def test_kv_streams_from_a_faulty_prefill(model_dir):
    seen: dict[str, int] = {}
    ids = itertools.count()

    async def main():
        holder = {}

        def wrap(inner):
            holder["p"] = FuzzPrefill(inner)
            return holder["p"]
        cfg = EngineConfig(model_dir=model_dir, num_pages=128)
        async with Harness(cfg, prefill_wrapper=wrap) as h:

            async def one(plan, prompt_len: int) -> None:
                rid = f"fuzz-{next(ids)}"
                holder["p"].plans[rid] = plan
                try:
                    async for _ in h.decode.GenerateTokens(pb.GenerateTokensRequest(
                            request_id=rid, prompt_token_ids=list(range(5, 5 + prompt_len)),
                            sampling=pb.SamplingParams(max_tokens=3), kv_source=pb.KV_SOURCE_REMOTE), timeout=30):
                        pass
                    code = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as e:
                    code = e.code()
                    assert code in ALLOWED, (code, e.details(), plan)
                seen[code.name] = seen.get(code.name, 0) + 1

            async def together(batch) -> None:
                await asyncio.gather(*[one(p, n) for p, n in batch])

            loop = asyncio.get_running_loop()

            @fuzz(EXAMPLES)
            @given(st.lists(st.tuples(PLAN, st.integers(1, 70)), min_size=BATCH, max_size=BATCH))
            def case(batch):
                # hypothesis drives a sync function: run the batch on the test's loop from a thread
                asyncio.run_coroutine_threadsafe(together(batch), loop).result(120)
                assert asyncio.run_coroutine_threadsafe(h.pools_back_to(64, 128), loop).result(60)

            clean = await h.generate(list(range(5, 45)), max_tokens=8, kv_source=pb.KV_SOURCE_REMOTE)
            await asyncio.to_thread(case)
            assert not h.engine._task.done()  # the step loop lives on
            assert await h.generate(list(range(5, 45)), max_tokens=8, kv_source=pb.KV_SOURCE_REMOTE) == clean
    asyncio.run(main())
    print("KV stream fuzz:", seen)
    assert sum(seen.values()) >= EXAMPLES * BATCH
    assert seen.get("OK", 0) > 0 and seen.get("DATA_LOSS", 0) > 0  # both sides of the property were exercised
