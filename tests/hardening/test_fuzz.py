"""Property-based fuzzing of every request field at the front door and at decode, over the three
services as real processes on loopback: whatever the fields hold, the answer is a precise status
(never UNKNOWN or INTERNAL), messages name no internal address, every service stays SERVING and
decode's KV pool is back at its baseline after each batch. Each hypothesis example is a batch of
BATCH requests sent at once (they meet in decode's running batch); 2,112 generated requests in all."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import Phase, given
from hypothesis import strategies as st

from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from tests.hardening.fuzz import fuzz, message, poison_float

NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
BATCH = 8
pool = ThreadPoolExecutor(BATCH)


def batch(cls, poison: bool = False):
    return st.lists(message(cls, poison), min_size=BATCH, max_size=BATCH)


def all_at_once(batch_name: str, calls) -> None:
    for f in [pool.submit(outcome, batch_name, c) for c in calls]:
        f.result()  # re-raises a failed case's assertion
seen: dict[str, dict[str, int]] = {}


def outcome(batch: str, call) -> None:
    try:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "DESCRIPTOR"):
            for _ in result:
                pass
        code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        code = e.code()
        assert code not in NEVER, f"{code.name}: {e.details()}"
        assert "127.0.0.1" not in (e.details() or ""), e.details()
    seen.setdefault(batch, {}).setdefault(code.name, 0)
    seen[batch][code.name] += 1


def after_batch(channels, batch: str, count: bool = True) -> None:
    """Every service SERVING, decode's pool back at baseline (nothing leaked by any case)."""
    for name, ch in channels.items():
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING, name
    decode = pbg.DecodeServiceStub(channels["decode_svc"])
    for _ in range(100):
        s = decode.GetPoolStats(pb.GetPoolStatsRequest(), timeout=5)
        if s.free_pages == s.total_pages and s.running == 0 and s.waiting == 0:
            break
        time.sleep(0.1)
    assert (s.free_pages, s.running, s.waiting) == (s.total_pages, 0, 0), s
    print(batch, seen.get(batch))
    assert not count or sum(seen[batch].values()) > 0


def test_front_door_generate_text(channels):
    stub = pbg.TokenizerServiceStub(channels["tokenizer_svc"])

    @fuzz(112)
    @given(batch(pb.GenerateTextRequest))
    def case(reqs):
        all_at_once("GenerateText", [lambda r=r: stub.GenerateText(r, timeout=20) for r in reqs])
    case()
    after_batch(channels, "GenerateText")


def test_front_door_tokenize_and_detokenize(channels):
    stub = pbg.TokenizerServiceStub(channels["tokenizer_svc"])

    @fuzz(26)
    @given(batch(pb.TokenizeRequest), batch(pb.DetokenizeRequest))
    def case(toks, detoks):
        all_at_once("Tokenize", [lambda r=r: stub.Tokenize(r, timeout=20) for r in toks] +
                    [lambda r=r: stub.Detokenize(r, timeout=20) for r in detoks])
    case()
    after_batch(channels, "Tokenize")


def test_decode_generate_tokens(channels):
    stub = pbg.DecodeServiceStub(channels["decode_svc"])

    @fuzz(100)
    @given(batch(pb.GenerateTokensRequest))
    def case(reqs):
        all_at_once("GenerateTokens", [lambda r=r: stub.GenerateTokens(r, timeout=20) for r in reqs])
    case()
    after_batch(channels, "GenerateTokens")


def test_decode_poison_sampling_floats(channels):
    stub = pbg.DecodeServiceStub(channels["decode_svc"])

    poison = st.tuples(st.sampled_from(["temperature", "top_p"]), poison_float("any"))

    @fuzz(25, phases=[Phase.explicit, Phase.generate])
    @given(st.lists(poison, min_size=BATCH, max_size=BATCH))
    def case(fields):
        reqs = []
        for name, value in fields:  # one poison value per request, every other field valid
            r = pb.GenerateTokensRequest(prompt_token_ids=[1, 2, 3], sampling=pb.SamplingParams(max_tokens=24))
            setattr(r.sampling, name, value)  # the tiny-temperature failure shows after ~20 tokens
            reqs.append(r)
        all_at_once("GenerateTokens-poison", [lambda r=r: stub.GenerateTokens(r, timeout=20) for r in reqs])
    try:
        case()
    finally:
        after_batch(channels, "GenerateTokens-poison", count=False)
