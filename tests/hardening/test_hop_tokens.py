"""Bearer tokens on every internal hop and every call kind, as real processes on loopback: prefill
and decode demand tokens (--auth-tokens-file), decode sends its own to prefill (--prefill-token-file),
the front door its own to decode (--decode-token-file). The hops' calls are server streams
(GenerateTokens, Prefill) as well as unary ones; each must carry the token."""
from __future__ import annotations

import grpc
import pytest

from kvwire.config import DEFAULT_MODEL_DIR
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from tests.hardening.procs import Service, serving

DECODE_TOKEN, PREFILL_TOKEN = "decode-hop-token", "prefill-hop-token"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    for name, token in (("decode", DECODE_TOKEN), ("prefill", PREFILL_TOKEN)):
        (d / name).write_text(f"# {name}'s accepted tokens\n{token}\n")
    model = ["--model-dir", str(DEFAULT_MODEL_DIR), "--num-pages", "128"]
    prefill = Service("prefill_svc", [*model, "--auth-tokens-file", str(d / "prefill")], d / "prefill.log")
    decode = Service("decode_svc", [*model, "--auth-tokens-file", str(d / "decode"), "--prefill-addr", prefill.addr,
                                    "--prefill-token-file", str(d / "prefill")], d / "decode.log")
    tokenizer = Service("tokenizer_svc", ["--model-dir", str(DEFAULT_MODEL_DIR), "--decode-addr", decode.addr,
                                          "--decode-token-file", str(d / "decode")], d / "tokenizer.log")
    with serving([prefill, decode, tokenizer]):
        yield {"prefill": prefill, "decode": decode, "tokenizer": tokenizer}


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.mark.parametrize("kv_source", [pb.KV_SOURCE_LOCAL, pb.KV_SOURCE_REMOTE])
def test_front_door_to_decode_streams_carry_the_token(stack, kv_source):
    """GenerateText -> GenerateTokens (server stream) -> with REMOTE, Prefill (server stream)."""
    with grpc.insecure_channel(stack["tokenizer"].addr) as ch:
        msgs = list(pbg.TokenizerServiceStub(ch).GenerateText(pb.GenerateTextRequest(
            text="The for statement", sampling=pb.SamplingParams(max_tokens=4), kv_source=kv_source), timeout=60))
    assert sum(len(m.token_ids) for m in msgs) == 4
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_decode_to_prefill_stream_carries_the_token(stack):
    with grpc.insecure_channel(stack["decode"].addr) as ch:
        stub = pbg.DecodeServiceStub(ch)
        req = pb.GenerateTokensRequest(prompt_token_ids=[1, 2, 3], sampling=pb.SamplingParams(max_tokens=3),
                                       kv_source=pb.KV_SOURCE_REMOTE)
        with pytest.raises(grpc.RpcError) as e:  # decode itself demands its token
            list(stub.GenerateTokens(req, timeout=60))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        out = [t for m in stub.GenerateTokens(req, timeout=60, metadata=bearer(DECODE_TOKEN)) for t in m.token_ids]
        assert len(out) == 3  # pulled from prefill over the authenticated Prefill stream
        assert stub.GetPoolStats(pb.GetPoolStatsRequest(), timeout=10, metadata=bearer(DECODE_TOKEN)).total_pages > 0


def test_prefill_refuses_calls_without_its_token(stack):
    with grpc.insecure_channel(stack["prefill"].addr) as ch:
        stub = pbg.PrefillServiceStub(ch)
        for metadata in (None, bearer(DECODE_TOKEN)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Prefill(pb.PrefillRequest(token_ids=[1, 2, 3]), timeout=30, metadata=metadata))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert len(list(stub.Prefill(pb.PrefillRequest(token_ids=[1, 2, 3]), timeout=30,
                                     metadata=bearer(PREFILL_TOKEN)))) > 2
