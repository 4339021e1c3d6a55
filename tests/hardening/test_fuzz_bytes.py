"""Raw request bytes at every RPC of the three services, as real processes on loopback: a string
field that is not UTF-8 is INVALID_ARGUMENT naming the field (never UNKNOWN), and hypothesis-made
bytes (random, truncated or bit-flipped messages, messages with a non-UTF-8 string spliced in)
get only documented codes. Sent through generic ``unary_unary`` / ``unary_stream`` callables with
identity serializers, so the client never parses or validates what it sends."""
from __future__ import annotations

import time

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protos.kvwire.v1 import kvwire_pb2 as pb
from tests.hardening.fuzz import fuzz, message

# Every code the API documents for a request that is wrong, too big or too slow; UNKNOWN and
# INTERNAL never (a server fault), UNAVAILABLE never (every peer is up).
DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED}
BAD_UTF8 = [b"\xff\xfeThe \xc3\x28", b"\xc3", b"\xed\xa0\x80", b"ok\xf0\x9f\x98", b"\x80", b"\xc0\xaf"]
DEADLINE_S = 5.0

# service, method, request class, server streaming
RPCS = [("tokenizer_svc", "kvwire.v1.TokenizerService", "GenerateText", pb.GenerateTextRequest, True),
        ("tokenizer_svc", "kvwire.v1.TokenizerService", "Tokenize", pb.TokenizeRequest, False),
        ("tokenizer_svc", "kvwire.v1.TokenizerService", "Detokenize", pb.DetokenizeRequest, False),
        ("decode_svc", "kvwire.v1.DecodeService", "GenerateTokens", pb.GenerateTokensRequest, True),
        ("decode_svc", "kvwire.v1.DecodeService", "GetPoolStats", pb.GetPoolStatsRequest, False),
        ("prefill_svc", "kvwire.v1.PrefillService", "Prefill", pb.PrefillRequest, True),
        ("prefill_svc", "kvwire.v1.PrefillService", "GetPrefillPoolStats", pb.GetPrefillPoolStatsRequest, False)]
EXAMPLES = {"GenerateText": 400, "GenerateTokens": 400, "Prefill": 400}  # the rest: 250 each; 2,200 in all


def call(channels, service: str, full: str, method: str, streaming: bool, data: bytes):
    """(code, details) of one call with ``data`` as the request's bytes."""
    ch = channels[service]
    path = f"/{full}/{method}"
    try:
        if streaming:
            for _ in ch.unary_stream(path)(data, timeout=DEADLINE_S):
                pass
        else:
            ch.unary_unary(path)(data, timeout=DEADLINE_S)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


# -- bytes: a key and a length-delimited payload, by hand ----------------------------------------

def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def delimited(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def repeated(f) -> bool:
    return f.label == f.LABEL_REPEATED if hasattr(f, "label") else f.is_repeated


def string_paths(desc, depth: int = 0) -> list[tuple[list, str]]:
    """Every string field reachable from ``desc``: (field descriptors from the top, dotted name)."""
    out = []
    for f in desc.fields:
        if f.type == f.TYPE_STRING:
            out.append(([f], f.name))
        elif f.type == f.TYPE_MESSAGE and depth < 3:
            out += [([f, *fs], f"{f.name}.{name}") for fs, name in string_paths(f.message_type, depth + 1)]
    return out


def spliced(fields: list, bad: bytes) -> bytes:
    """A (nested) string field holding ``bad``, as wire bytes to append to a message."""
    data = bad
    for f in reversed(fields):
        data = delimited(f.number, data)
    return data


def raw_requests(cls) -> st.SearchStrategy[bytes]:
    valid = message(cls).map(lambda m: m.SerializeToString())
    paths = string_paths(cls.DESCRIPTOR)
    kinds = [st.binary(max_size=200),  # noise
             st.tuples(valid, st.integers(0, 400)).map(lambda t: t[0][:t[1]]),  # cut short
             st.tuples(valid, st.integers(0, 400), st.integers(1, 255)).map(  # one byte changed
                 lambda t: t[0][:t[1]] + bytes([t[0][t[1]] ^ t[2]]) + t[0][t[1] + 1:] if t[1] < len(t[0]) else t[0])]
    if paths:
        kinds.append(st.tuples(valid, st.sampled_from(paths), st.sampled_from(BAD_UTF8)).map(
            lambda t: t[0] + spliced(t[1][0], t[2])))
    return st.one_of(kinds)


@pytest.mark.parametrize("service, full, method, cls, streaming", RPCS, ids=[r[2] for r in RPCS])
def test_invalid_utf8_is_invalid_argument_naming_the_field(channels, service, full, method, cls, streaming):
    paths = string_paths(cls.DESCRIPTOR)
    for fields, name in paths:
        code, details = call(channels, service, full, method, streaming, spliced(fields, BAD_UTF8[0]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
        want = ".".join(f.name + ("[0]" if repeated(f) else "") for f in fields)
        assert details.startswith(f"{want} is not valid UTF-8"), (name, details)
    # A message that is not protobuf at all: INVALID_ARGUMENT too (also for RPCs with no string field).
    code, details = call(channels, service, full, method, streaming, b"\x0a\xff\xff")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and cls.DESCRIPTOR.name in details, details


def test_the_reported_request_gives_its_field(channels):
    """The attacker's request: GenerateText with b"\\xff\\xfeThe \\xc3\\x28" in text."""
    code, details = call(channels, "tokenizer_svc", "kvwire.v1.TokenizerService", "GenerateText", True,
                         delimited(2, b"\xff\xfeThe \xc3\x28"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("text is not valid UTF-8"), details


sent: dict[str, dict[str, int]] = {}


@pytest.mark.parametrize("service, full, method, cls, streaming", RPCS, ids=[r[2] for r in RPCS])
def test_generated_bytes_get_only_documented_codes(channels, service, full, method, cls, streaming):
    counts = sent.setdefault(method, {})
    start = time.monotonic()

    @fuzz(EXAMPLES.get(method, 250))
    @given(raw_requests(cls))
    def case(data):
        code, details = call(channels, service, full, method, streaming, data)
        assert code in DOCUMENTED, f"{code.name}: {details}"
        assert "127.0.0.1" not in details and "Unexpected" not in details, details
        counts[code.name] = counts.get(code.name, 0) + 1
    case()
    print(method, counts, f"{time.monotonic() - start:.1f} s")
    assert sum(counts.values()) == EXAMPLES.get(method, 250)
    assert counts.get("INVALID_ARGUMENT", 0) > 0  # the generator does reach the parse errors
