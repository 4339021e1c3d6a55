"""TLS, mTLS and bearer tokens on a real gRPC server on loopback (kvwire_serving.server + kvwire_serving.security),
with certificates made in the test. The three-service version is test_secure_stack.py."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvwire.config import DEFAULT_MODEL_DIR
from kvwire_serving.security import ClientSecurity, ServerSecurity, TokenSet
from kvwire_serving.server import GrpcServer, build_channel
from kvwire.tokenizer import ModelTokenizer
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from tests.hardening.certs import CA
from tokenizer_svc.server import SERVICE_NAME, TokenizerServicer

TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, other = CA(d, "kvwire-test-ca"), CA(d, "rogue-ca")
    tokens = d / "tokens"
    tokens.write_text(f"# accepted tokens\n{TOKEN}\nsecond-token\n")
    token_file = d / "client-token"
    token_file.write_text(TOKEN + "\n")
    return {"ca": ca, "other": other, "server": ca.issue("tokenizer", server=True),
            "client": ca.issue("decode", server=False), "stranger": ca.issue("intruder", server=False),
            "rogue_client": other.issue("decode", server=False), "tokens": tokens, "token_file": token_file}


async def serve(security: ServerSecurity, reflection: bool = True) -> GrpcServer:
    server = GrpcServer(tracing=False, security=security, reflection=reflection)
    servicer = TokenizerServicer(ModelTokenizer(DEFAULT_MODEL_DIR), None, "kvwire-tiny")
    server.add_service(pbg.add_TokenizerServiceServicer_to_server, servicer, SERVICE_NAME)
    await server.start("127.0.0.1:0")
    await server.set_serving()
    return server


async def tokenize(port: int, security: ClientSecurity | None = None, metadata=None) -> grpc.StatusCode:
    async with build_channel(f"localhost:{port}", tracing=False, security=security) as ch:
        try:
            reply = await pbg.TokenizerServiceStub(ch).Tokenize(pb.TokenizeRequest(text="hello"), timeout=5,
                                                                metadata=metadata)
            assert len(reply.token_ids) > 0
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            return e.code()


async def health(port: int, security: ClientSecurity | None = None) -> int:
    async with build_channel(f"localhost:{port}", tracing=False, security=security) as ch:
        return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)).status


def test_mtls_refuses_plaintext_and_wrong_ca_and_serves_a_good_client(pki):
    async def main():
        server = await serve(ServerSecurity(cert_file=pki["server"].cert, key_file=pki["server"].key,
                                            client_ca_file=pki["ca"].pem))
        good = ClientSecurity(ca_file=pki["ca"].pem, cert_file=pki["client"].cert, key_file=pki["client"].key)
        try:
            assert await tokenize(server.port, good) == grpc.StatusCode.OK
            assert await tokenize(server.port) == grpc.StatusCode.UNAVAILABLE  # plaintext: no handshake
            # a client certificate from another CA
            assert await tokenize(server.port, ClientSecurity(
                ca_file=pki["ca"].pem, cert_file=pki["rogue_client"].cert,
                key_file=pki["rogue_client"].key)) == grpc.StatusCode.UNAVAILABLE
            # no client certificate at all
            assert await tokenize(server.port, ClientSecurity(ca_file=pki["ca"].pem)) == grpc.StatusCode.UNAVAILABLE
            # the client does not trust the server's CA
            assert await tokenize(server.port, ClientSecurity(
                ca_file=pki["other"].pem, cert_file=pki["client"].cert,
                key_file=pki["client"].key)) == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(0)
    asyncio.run(main())


def test_allowed_peers_gives_permission_denied_to_other_certificates(pki):
    async def main():
        server = await serve(ServerSecurity(cert_file=pki["server"].cert, key_file=pki["server"].key,
                                            client_ca_file=pki["ca"].pem, allowed_peers=("decode",)))
        try:
            good = ClientSecurity(ca_file=pki["ca"].pem, cert_file=pki["client"].cert, key_file=pki["client"].key)
            stranger = ClientSecurity(ca_file=pki["ca"].pem, cert_file=pki["stranger"].cert,
                                      key_file=pki["stranger"].key)
            assert await tokenize(server.port, good) == grpc.StatusCode.OK
            assert await tokenize(server.port, stranger) == grpc.StatusCode.PERMISSION_DENIED
            assert await health(server.port, stranger) == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(0)
    asyncio.run(main())


def test_bearer_tokens_over_tls_and_health_without_one(pki):
    async def main():
        server = await serve(ServerSecurity(cert_file=pki["server"].cert, key_file=pki["server"].key,
                                            tokens_file=pki["tokens"], health_listen="127.0.0.1:0"))
        tls = ClientSecurity(ca_file=pki["ca"].pem)
        try:
            assert await tokenize(server.port, tls) == grpc.StatusCode.UNAUTHENTICATED
            assert await tokenize(server.port, tls, metadata=(("authorization", "Bearer nope"),)) == \
                grpc.StatusCode.UNAUTHENTICATED
            assert await tokenize(server.port, tls, metadata=(("authorization", f"Basic {TOKEN}"),)) == \
                grpc.StatusCode.UNAUTHENTICATED
            assert await tokenize(server.port, tls, metadata=(("authorization", "Bearer second-token"),)) == \
                grpc.StatusCode.OK
            with_token = ClientSecurity(ca_file=pki["ca"].pem, token_file=pki["token_file"])
            assert await tokenize(server.port, with_token) == grpc.StatusCode.OK
            assert await tokenize(server.port) == grpc.StatusCode.UNAVAILABLE  # plaintext to a TLS port
            # probes: health on the TLS port without a token, and on the plaintext health-only port
            assert await health(server.port, tls) == health_pb2.HealthCheckResponse.SERVING
            assert await health(server.health_port) == health_pb2.HealthCheckResponse.SERVING
            assert await tokenize(server.health_port) == grpc.StatusCode.UNIMPLEMENTED  # nothing else there
        finally:
            await server.stop(0)
    asyncio.run(main())


def test_no_reflection():
    async def main():
        on, off = await serve(ServerSecurity()), await serve(ServerSecurity(), reflection=False)
        try:
            def services(port):
                with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                    return ProtoReflectionDescriptorDatabase(ch).get_services()
            assert SERVICE_NAME in await asyncio.to_thread(services, on.port)
            with pytest.raises(grpc.RpcError) as e:
                await asyncio.to_thread(services, off.port)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await on.stop(0)
            await off.stop(0)
    asyncio.run(main())


def test_token_set_compares_every_token():
    tokens = TokenSet(["a" * 40, "b"])
    assert tokens.accepts("b") and tokens.accepts("a" * 40)
    assert not tokens.accepts("") and not tokens.accepts("a") and not tokens.accepts("b ")
