"""mTLS between the three services and bearer tokens at the front door, as real processes on loopback
with certificates made in the test: plaintext refused, wrong CA refused, good client served, at every hop."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest

from kvwire.config import DEFAULT_MODEL_DIR
from kvwire_serving.security import ClientSecurity
from kvwire_serving.server import build_channel
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from tests.hardening.certs import CA
from tests.hardening.procs import Service, serving
from tools.stack import REPO

TOKEN = "front-door-token"


def _decode_has_tls_flags() -> bool:
    out = subprocess.run([sys.executable, "-m", "decode_svc", "--help"], cwd=REPO, capture_output=True, text=True)
    return "--prefill-tls-ca" in out.stdout


pytestmark = pytest.mark.skipif(not _decode_has_tls_flags(),
                                reason="decode_svc does not take the TLS flags (kvwire_serving.security) yet")


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    d = tmp_path_factory.mktemp("secure")
    ca, rogue = CA(d, "ca"), CA(d, "rogue")
    srv = {n: ca.issue(n, server=True) for n in ("prefill", "decode", "tokenizer")}
    cli = {n: ca.issue(n, server=False) for n in ("decode", "tokenizer", "stranger")}
    (d / "tokens").write_text(TOKEN + "\n")

    def server_flags(name: str, allowed: str | None) -> list[str]:
        flags = ["--tls-cert", str(srv[name].cert), "--tls-key", str(srv[name].key)]
        return flags + (["--tls-client-ca", str(ca.pem), "--allowed-peers", allowed] if allowed else [])

    engine = ["--model-dir", str(DEFAULT_MODEL_DIR), "--num-pages", "256"]
    prefill = Service("prefill_svc", engine + server_flags("prefill", "decode"), d / "prefill.log")
    decode = Service("decode_svc", engine + server_flags("decode", "tokenizer") + [
        "--prefill-addr", "", "--prefill-tls-ca", str(ca.pem), "--prefill-tls-cert", str(cli["decode"].cert),
        "--prefill-tls-key", str(cli["decode"].key)], d / "decode.log")
    decode.args[decode.args.index("--prefill-addr") + 1] = prefill.addr
    tokenizer = Service("tokenizer_svc", ["--model-dir", str(DEFAULT_MODEL_DIR), *server_flags("tokenizer", None),
                                          "--auth-tokens-file", str(d / "tokens"), "--decode-addr", decode.addr,
                                          "--decode-tls-ca", str(ca.pem), "--decode-tls-cert",
                                          str(cli["tokenizer"].cert), "--decode-tls-key", str(cli["tokenizer"].key)],
                        d / "tokenizer.log")
    with serving([prefill, decode, tokenizer]):
        yield {"ca": ca, "rogue": rogue, "cli": cli, "prefill": prefill, "decode": decode, "tokenizer": tokenizer}


async def _generate(addr: str, security: ClientSecurity | None, metadata=None) -> tuple[grpc.StatusCode, list[int]]:
    async with build_channel(addr, tracing=False, security=security) as ch:
        ids = []
        try:
            async for msg in pbg.TokenizerServiceStub(ch).GenerateText(pb.GenerateTextRequest(
                    text="The for statement", sampling=pb.SamplingParams(max_tokens=8)), timeout=60, metadata=metadata):
                ids += msg.token_ids
            return grpc.StatusCode.OK, ids
        except grpc.aio.AioRpcError as e:
            return e.code(), ids


def generate(addr, security=None, metadata=None):
    return asyncio.run(_generate(addr, security, metadata))


def test_front_door_needs_tls_and_a_token(secure):
    addr, ca = secure["tokenizer"].addr, secure["ca"].pem
    code, ids = generate(addr, ClientSecurity(ca_file=ca), (("authorization", f"Bearer {TOKEN}"),))
    assert code == grpc.StatusCode.OK and len(ids) == 8  # through tokenizer -> decode -> prefill, all mTLS
    assert generate(addr, ClientSecurity(ca_file=ca))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert generate(addr, ClientSecurity(ca_file=ca), (("authorization", "Bearer wrong"),))[0] == \
        grpc.StatusCode.UNAUTHENTICATED
    assert generate(addr)[0] == grpc.StatusCode.UNAVAILABLE  # plaintext client
    assert generate(addr, ClientSecurity(ca_file=secure["rogue"].pem),  # does not trust the server
                    (("authorization", f"Bearer {TOKEN}"),))[0] == grpc.StatusCode.UNAVAILABLE


async def _pool_stats(addr: str, security: ClientSecurity | None) -> grpc.StatusCode:
    async with build_channel(addr, tracing=False, security=security) as ch:
        try:
            await pbg.DecodeServiceStub(ch).GetPoolStats(pb.GetPoolStatsRequest(), timeout=10)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            return e.code()


async def _prefill(addr: str, security: ClientSecurity | None) -> grpc.StatusCode:
    async with build_channel(addr, tracing=False, security=security) as ch:
        try:
            async for _ in pbg.PrefillServiceStub(ch).Prefill(pb.PrefillRequest(token_ids=[1, 2, 3]), timeout=30):
                pass
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            return e.code()


@pytest.mark.parametrize("hop, call, allowed", [("decode", _pool_stats, "tokenizer"), ("prefill", _prefill, "decode")])
def test_internal_hops_need_the_right_client_certificate(secure, hop, call, allowed):
    addr, ca, cli = secure[hop].addr, secure["ca"].pem, secure["cli"]

    def as_(name, ca_file=ca):
        return ClientSecurity(ca_file=ca_file, cert_file=cli[name].cert, key_file=cli[name].key)
    assert asyncio.run(call(addr, as_(allowed))) == grpc.StatusCode.OK
    assert asyncio.run(call(addr, None)) == grpc.StatusCode.UNAVAILABLE  # plaintext
    assert asyncio.run(call(addr, ClientSecurity(ca_file=ca))) == grpc.StatusCode.UNAVAILABLE  # no client cert
    assert asyncio.run(call(addr, as_(allowed, secure["rogue"].pem))) == grpc.StatusCode.UNAVAILABLE  # wrong CA
    assert asyncio.run(call(addr, as_("stranger"))) == grpc.StatusCode.PERMISSION_DENIED  # valid, not allowed
