"""TLS, mTLS and bearer-token auth for every hop, and the serving flags that limit exposure.

One module builds every credential: ``ServerSecurity`` (what a service's listener demands) and
``ClientSecurity`` (what one outgoing channel presents), both frozen and filled from the parsed
flags by ``server_security`` / ``client_security`` (the flags are declared in ``kvwire.args``; their
``KVWIRE_*`` defaults in ``kvwire.envs``).

- ``--tls-cert/--tls-key``: the listener speaks TLS. ``--tls-client-ca``: it also requires a client
  certificate signed by that CA (mTLS; a plaintext or wrongly signed client fails the handshake).
  ``--allowed-peers``: of those, only certificates naming one of these (CN or SAN) may call;
  others get PERMISSION_DENIED.
- ``--auth-tokens-file``: every call (health excepted) needs ``authorization: Bearer <token>``
  with a token from the file (one per line; ``#`` comments). Missing or wrong -> UNAUTHENTICATED.
  Compared in constant time, over SHA-256 digests so a token's length does not leak either.
- ``--<peer>-tls-ca/-cert/-key/-token-file/-tls-server-name``: what the channel to ``<peer>``
  (``decode`` from the tokenizer, ``prefill`` from decode) verifies and presents.
- ``--health-listen``: a second, plaintext listener serving only ``grpc.health.v1`` (kubelet gRPC
  probes speak neither TLS nor tokens); health on the main port needs no token either.
"""
from __future__ import annotations

import hashlib
import hmac
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import grpc

from kvwire import metrics

HEALTH_PREFIX = "/grpc.health.v1.Health/"


def _read(path: Path | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


@dataclass(frozen=True)
class ServerSecurity:
    cert_file: Path | None = None
    key_file: Path | None = None
    client_ca_file: Path | None = None  # set: mTLS, client certificates required and verified
    allowed_peers: tuple[str, ...] = ()  # mTLS identities (CN / SAN) allowed; empty: any verified one
    tokens_file: Path | None = None  # bearer tokens accepted; None: no token needed
    health_listen: str | None = None  # plaintext health-only listener

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.client_ca_file is not None and self.cert_file is None:
            raise ValueError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")
        if self.allowed_peers and self.client_ca_file is None:
            raise ValueError("--allowed-peers needs --tls-client-ca (identities come from client certificates)")

    @property
    def tls(self) -> bool:
        return self.cert_file is not None

    def credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        ca = _read(self.client_ca_file)
        return grpc.ssl_server_credentials([(_read(self.key_file), _read(self.cert_file))],
                                           root_certificates=ca, require_client_auth=ca is not None)

    def interceptor(self) -> "AuthInterceptor | None":
        tokens = TokenSet.from_file(self.tokens_file) if self.tokens_file else None
        if tokens is None and not self.allowed_peers:
            return None
        return AuthInterceptor(tokens, frozenset(self.allowed_peers))


@dataclass(frozen=True)
class ClientSecurity:
    ca_file: Path | None = None  # set: TLS, the server verified against this CA
    cert_file: Path | None = None  # with key_file: the client certificate (mTLS)
    key_file: Path | None = None
    token_file: Path | None = None  # bearer token sent on every call (first token in the file)
    server_name: str | None = None  # expected name in the server certificate, if not the target's host

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate needs both its cert and key")
        if self.cert_file is not None and self.ca_file is None:
            raise ValueError("a client certificate (mTLS) needs the server's CA too")

    def credentials(self) -> grpc.ChannelCredentials | None:
        if self.ca_file is None:
            return None
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca_file), private_key=_read(self.key_file),
                                            certificate_chain=_read(self.cert_file))

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def interceptors(self) -> list:
        if self.token_file is None:
            return []
        tokens = TokenSet.from_file(self.token_file).tokens
        if not tokens:
            raise ValueError(f"{self.token_file} holds no token")
        return bearer_token_interceptors(tokens[0])


class TokenSet:
    """Accepted bearer tokens, compared in constant time (digests, so length does not leak)."""

    def __init__(self, tokens: Iterable[str]):
        self.tokens = tuple(tokens)
        self._digests = tuple(hashlib.sha256(t.encode()).digest() for t in self.tokens)

    @staticmethod
    def from_file(path: Path) -> "TokenSet":
        lines = Path(path).read_text().splitlines()
        return TokenSet(ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#"))

    def accepts(self, presented: str) -> bool:
        d = hashlib.sha256(presented.encode()).digest()
        ok = False
        for known in self._digests:  # no early exit: every token is compared
            ok |= hmac.compare_digest(d, known)
        return ok


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key.lower() == "authorization":
            scheme, _, token = (value.decode() if isinstance(value, bytes) else value).partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else ""
    return None


def peer_names(context: grpc.aio.ServicerContext) -> set[str]:
    auth = context.auth_context() or {}
    names = auth.get("x509_subject_alternative_name", []) + auth.get("x509_common_name", [])
    return {n.decode() if isinstance(n, bytes) else n for n in names}


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Bearer tokens and allowed mTLS identities, checked before the handler runs (health exempt)."""

    def __init__(self, tokens: TokenSet | None, allowed_peers: frozenset[str]):
        self.tokens = tokens
        self.allowed_peers = allowed_peers

    def check(self, context: grpc.aio.ServicerContext) -> tuple[grpc.StatusCode, str] | None:
        if self.tokens is not None:
            token = bearer_token(context.invocation_metadata())
            if not token:
                return grpc.StatusCode.UNAUTHENTICATED, "missing credentials: send 'authorization: Bearer <token>'"
            if not self.tokens.accepts(token):
                return grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token"
        if self.allowed_peers and not (peer_names(context) & self.allowed_peers):
            return grpc.StatusCode.PERMISSION_DENIED, "this client certificate is not allowed to call this service"
        return None

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        method = handler_call_details.method
        kind = ("stream" if handler.request_streaming else "unary") + "_" + (
            "stream" if handler.response_streaming else "unary")
        return handler._replace(**{kind: _guarded(getattr(handler, kind), self.check, method)})


def _guarded(behavior: Callable, check: Callable, method: str) -> Callable:
    async def deny_if_needed(context) -> None:
        denied = check(context)
        if denied is not None:
            metrics.GRPC_ERRORS.labels(method, denied[0].name).inc()
            await context.abort(*denied)

    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            await deny_if_needed(context)
            async for response in behavior(request, context):
                yield response
        return stream

    async def unary(request, context):
        await deny_if_needed(context)
        return await behavior(request, context)
    return unary


class _BearerToken:
    """Adds ``authorization: Bearer <token>`` to a call's metadata."""

    def __init__(self, token: str):
        self._pair = ("authorization", f"Bearer {token}")

    def _details(self, d):
        return d._replace(metadata=grpc.aio.Metadata(*(tuple(d.metadata or ()) + (self._pair,))))


# One class per call kind, never one class for all four: grpc.aio files each client interceptor
# under the first kind it subclasses (an if/elif over the four bases), so a class deriving from
# all four would run on unary-unary calls only and streaming calls would go out without a token.
class _UnaryUnaryBearer(_BearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStreamBearer(_BearerToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnaryBearer(_BearerToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStreamBearer(_BearerToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def bearer_token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that send ``token`` on every call of a channel, whatever its kind."""
    return [cls(token) for cls in (_UnaryUnaryBearer, _UnaryStreamBearer, _StreamUnaryBearer, _StreamStreamBearer)]


# -- from parsed flags (kvwire.args: SecurityArgs, PeerArgs, ServingArgs) ---------------------------

def _path(value: str | Path | None) -> Path | None:
    return Path(value) if value else None


def server_security(args: Any) -> ServerSecurity:
    """What the listener demands, from ``--tls-*``, ``--allowed-peers``, ``--auth-tokens-file``,
    ``--health-listen`` (an ``EngineArgs.security`` section, or anything with those names)."""
    peers = tuple(p.strip() for p in (args.allowed_peers or "").split(",") if p.strip())
    return ServerSecurity(cert_file=_path(args.tls_cert), key_file=_path(args.tls_key),
                          client_ca_file=_path(args.tls_client_ca), allowed_peers=peers,
                          tokens_file=_path(args.auth_tokens_file), health_listen=args.health_listen or None)


def client_security(args: Any, peer: str | None = None) -> ClientSecurity:
    """What the channel to a peer presents: an ``EngineArgs.peer`` section, or (``peer`` given) a
    namespace with ``<peer>_tls_ca`` ... attributes."""
    get = (lambda name: getattr(args, f"{peer}_{name}")) if peer else (lambda name: getattr(args, name))  # noqa: E731
    return ClientSecurity(ca_file=_path(get("tls_ca")), cert_file=_path(get("tls_cert")),
                          key_file=_path(get("tls_key")), token_file=_path(get("token_file")),
                          server_name=get("tls_server_name") or None)


def metrics_host(args: Any) -> str:
    """``--metrics-host``, else ``--listen``'s host: /metrics is no more exposed than the service."""
    if args.metrics_host:
        return args.metrics_host
    host = args.listen.rpartition(":")[0].strip("[]")
    return host or "0.0.0.0"
