"""gRPC serving, solved once for every kvwire service.

A service's ``__main__`` does::

    server = GrpcServer()                                   # sizes, interceptors, health, reflection
    server.add_service(kvwire_pb2_grpc.add_DecodeServiceServicer_to_server, servicer,
                       "kvwire.v1.DecodeService")
    port = await server.start("0.0.0.0:50052")             # health: NOT_SERVING
    ...load weights, warm up...
    await server.set_serving()                              # health: SERVING
    await server.serve_until_signal(grace_s=30)             # SIGTERM: NOT_SERVING, drain, stop

and talks to its peers through ``build_channel("dns:///decode:50052")`` (explicit message sizes,
round-robin over every address the name resolves to, tracing). Servicers stay thin: they raise
``kvwire.errors`` exceptions and the error interceptor turns them into statuses.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import json
import logging
import re
import signal
import time
from functools import partial
from typing import Any, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.instrumentation.grpc.filters import any_of, health_check, negate, service_prefix

from kvwire import errors, metrics
from kvwire_serving.request_decode import message_class, parse_request
from kvwire_serving.security import ClientSecurity, ServerSecurity

log = logging.getLogger(__name__)

# Well above the <= 1 MiB KV chunks, and stated explicitly on both ends (the default receive
# limit is 4 MiB; a silent mismatch surfaces only with a large prompt).
DEFAULT_MAX_MESSAGE_BYTES = 8 << 20

# Most specific first: the first class in an exception's MRO found here gives its status.
_STATUS_BY_EXCEPTION: dict[type, grpc.StatusCode] = {
    errors.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.DataLoss: grpc.StatusCode.DATA_LOSS,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.KvwireError: grpc.StatusCode.INTERNAL,
    TimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
    NotImplementedError: grpc.StatusCode.UNIMPLEMENTED,
}


# Internal topology never reaches a client: peer addresses (ipv4:1.2.3.4:5, [::1]:5, dns:///x:5,
# unix:/p), host:port pairs and absolute file paths in a message are replaced; the server log keeps them.
_INTERNAL_DETAIL = re.compile(
    r"(?:ipv[46]:|dns:/*|unix:|unix-abstract:)\S+"  # a gRPC peer or target, up to the next space
    r"|\[[0-9a-fA-F.]*:[0-9a-fA-F:.]*\](?::\d+)?"  # [ipv6]:port
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"  # ipv4[:port]
    r"|\b[A-Za-z][\w.-]*:\d{2,5}\b"  # host:port
    r"|(?<![\w:/])/(?:[\w.+-]+/)+[\w.+-]*")  # /an/absolute/path
# A peer's transport failure: its own wording (addresses, resolver errors) stays in the log.
_PEER_TRANSPORT_MESSAGE = {
    grpc.StatusCode.UNAVAILABLE: "a backend service is unavailable; retry later",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline exceeded waiting for a backend service",
}


def public_message(message: str) -> str:
    """``message`` with internal addresses and file paths replaced by ``<internal>``."""
    return _INTERNAL_DETAIL.sub("<internal>", message)


def is_oversized_reply(exc: grpc.aio.AioRpcError) -> bool:
    """A message from the peer over our receive limit: gRPC reports RESOURCE_EXHAUSTED, but retrying
    cannot help (an oversized KV chunk is a broken stream), so it is DATA_LOSS to our caller.
    ("SERVER: Received message larger than max" is the peer refusing *our* request: left as is.)"""
    details = exc.details() or ""
    return (exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details
            and not details.startswith("SERVER:"))


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a caller gets for ``exc`` (the one mapping in the project).

    A peer's ``AioRpcError`` keeps its code (UNAVAILABLE when the peer is down), except UNKNOWN,
    which becomes INTERNAL; its details pass on unless they are the channel's own (UNAVAILABLE,
    DEADLINE_EXCEEDED), which name internal addresses. Unexpected exceptions become INTERNAL with a
    short message that names only the exception type; the traceback goes to the server log.
    Messages never carry internal addresses or paths (``public_message``).
    """
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
        if is_oversized_reply(exc):
            return grpc.StatusCode.DATA_LOSS, ("a backend service sent a message larger than the limit (a KV chunk "
                                               "is at most 1 MiB): corrupt stream or misconfigured peer")
        code = grpc.StatusCode.INTERNAL if code == grpc.StatusCode.UNKNOWN else code
        return code, _PEER_TRANSPORT_MESSAGE.get(code) or public_message(exc.details() or "")
    for cls in type(exc).__mro__:
        code = _STATUS_BY_EXCEPTION.get(cls)
        if code is not None and code != grpc.StatusCode.INTERNAL:
            return code, public_message(str(exc) or type(exc).__name__)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"


async def _abort_with(exc: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    code, message = status_for(exc)
    metrics.GRPC_ERRORS.labels(method, code.name).inc()
    if code == grpc.StatusCode.INTERNAL and not isinstance(exc, grpc.aio.AioRpcError):
        log.error("%s failed unexpectedly", method, exc_info=exc)
    else:  # the full detail (peer addresses included) for the operator, not the caller
        detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        log.info("%s -> %s: %s", method, code.name, detail)
    await context.abort(code, message)


def _wrap(behavior: Callable, method: str, response_streaming: bool,
          parse: Callable[[bytes], Any] | None = None) -> Callable:
    """``parse``: the request arrives as bytes and is parsed here, where a parse error can become
    INVALID_ARGUMENT (gRPC's own parse would answer UNKNOWN)."""
    if response_streaming and inspect.isasyncgenfunction(behavior):
        async def stream_wrapper(request: Any, context: grpc.aio.ServicerContext):
            try:
                if parse is not None:
                    request = parse(request)
                # aclosing: on cancellation the handler's own `finally` runs now, not at GC time.
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status, never UNKNOWN
                await _abort_with(exc, context, method)
        return stream_wrapper
    if inspect.iscoroutinefunction(behavior):  # unary response, or streaming via context.write
        async def wrapper(request: Any, context: grpc.aio.ServicerContext):
            try:
                if parse is not None:
                    request = parse(request)
                return await behavior(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001
                await _abort_with(exc, context, method)
        return wrapper
    return behavior  # synchronous handlers are not used in kvwire; leave them alone


_closing: set[asyncio.Task] = set()  # strong references until each close has run


def close_when_rpc_ends(context: grpc.aio.ServicerContext, stream: Any) -> None:
    """Close the async generator ``stream`` as soon as the RPC ends, whatever its handler does.

    On a cancelled call grpc may stop iterating a streaming handler that sits at a ``yield`` (it
    was awaiting the write) without closing it: the ``finally`` of every generator under it, the one
    that frees a request's pages, would then wait for garbage collection. A generator that is
    running (awaiting inside) is left alone: the cancellation of its task reaches it there. Closing
    an exhausted generator does nothing."""
    loop = asyncio.get_running_loop()

    async def close() -> None:
        with contextlib.suppress(RuntimeError):  # started running in the meantime: cancelled there
            await stream.aclose()

    def schedule() -> None:
        if not stream.ag_running:
            task = loop.create_task(close())
            _closing.add(task)
            task.add_done_callback(_closing.discard)

    context.add_done_callback(lambda _: loop.call_soon_threadsafe(schedule))


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The caller's deadline in ``time.monotonic()`` seconds, or None when it set none."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every async handler so exceptions leave as statuses chosen by :func:`status_for`."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        metrics.GRPC_REQUESTS.labels(method).inc()  # per replica: where a balancer sent its calls
        kind = ("stream" if handler.request_streaming else "unary") + "_" + (
            "stream" if handler.response_streaming else "unary")
        behavior = getattr(handler, kind)
        wrapped = inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)
        cls = None if handler.request_streaming or not wrapped else message_class(handler.request_deserializer)
        parse = None if cls is None else partial(parse_request, cls)
        if parse is not None:  # bytes in: parsed inside the wrapper (see kvwire_serving/request_decode.py)
            handler = handler._replace(request_deserializer=None)
        return handler._replace(**{kind: _wrap(behavior, method, handler.response_streaming, parse)})


def _traced() -> Callable:
    # Probes and reflection would otherwise flood the trace backend with one trace each.
    return negate(any_of(health_check(), service_prefix("grpc.reflection")))


# Keepalive: a peer that vanished without a FIN (node lost, network partition) is noticed within
# KEEPALIVE_TIME + KEEPALIVE_TIMEOUT instead of never, also while a stream carries no data (a
# stalled KV pull: max_pings_without_data 0 = keep pinging). Servers accept pings this often. A peer
# that is alive but sends nothing is bounded by the call's deadline (decode: --kv-transfer-timeout-s).
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000
MAX_RECONNECT_BACKOFF_MS = 5_000


# Retries (gRPC's retryPolicy, every method): a call that failed UNAVAILABLE before any response
# (the replica died, was still loading, refused the stream) is tried again on the next replica
# round_robin picks. gRPC commits a call once response headers arrive, and a server sends them
# with its first message at the latest, so a stream that produced a token is never retried (no
# duplicated output; tests/integration/test_retry_policy.py). No hedgingPolicy: a hedge would run
# the same generation twice. No retryThrottling: a restarted replica refuses every call while it
# loads (UNAVAILABLE), and a throttle would turn those retries into failures; 3 attempts bound the load.
RETRY_POLICY = {"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s", "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"]}


def service_config() -> dict[str, Any]:
    """Round-robin over every resolved address, with the retry rule above."""
    return {"loadBalancingConfig": [{"round_robin": {}}],
            "methodConfig": [{"name": [{}], "retryPolicy": RETRY_POLICY}]}


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.http2.max_pings_without_data", 0),
            # A peer that was down is retried at least this often (gRPC's default backoff grows to
            # 2 minutes): decode notices a restarted prefill within seconds.
            ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
            ("grpc.enable_retries", 1),
            ("grpc.service_config", json.dumps(service_config()))]


def build_channel(target: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                  tracing: bool = True, tracer_provider=None,
                  security: ClientSecurity | None = None) -> grpc.aio.Channel:
    """An aio channel to ``target`` (``host:port``, ``dns:///name:port`` or ``ipv4:a:p,b:p``): TLS / mTLS and a bearer
    token when ``security`` says so, plaintext otherwise.

    Round-robin load balancing spreads calls over every address a ``dns:///`` name resolves to
    (a Kubernetes headless service's replicas); calls that fail UNAVAILABLE before any response
    are retried (``RETRY_POLICY``). Tracing injects W3C ``traceparent`` metadata.
    """
    security = security or ClientSecurity()
    interceptors = list(security.interceptors())
    if tracing:
        interceptors += aio_client_interceptors(tracer_provider=tracer_provider, filter_=_traced())
    options = channel_options(max_message_bytes) + security.options()
    creds = security.credentials()
    if creds is not None:
        return grpc.aio.secure_channel(target, creds, options=options, interceptors=interceptors or None)
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors or None)


class GrpcServer:
    """A ``grpc.aio`` server with health, reflection, tracing and error mapping built in.

    Health (``grpc.health.v1``) reports NOT_SERVING for the server ("") and every added service
    from ``start()`` until ``set_serving()``, and again from shutdown on.
    """

    def __init__(self, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 tracing: bool = True, tracer_provider=None, security: ServerSecurity | None = None,
                 reflection: bool = True):
        self.security = security or ServerSecurity()
        self.reflection = reflection
        interceptors: list[grpc.aio.ServerInterceptor] = []
        auth = self.security.interceptor()
        if auth is not None:  # outermost: an unauthenticated call reaches nothing else
            interceptors.append(auth)
        if tracing:  # outermost, so its span records the status the error interceptor sets
            interceptors.append(aio_server_interceptor(tracer_provider=tracer_provider,
                                                       filter_=_traced()))
        interceptors.append(ErrorMappingInterceptor())
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),  # a second process on the same port fails loudly
            ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
            ("grpc.keepalive_permit_without_calls", 1),
        ])
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.health_server: grpc.aio.Server | None = None  # --health-listen: plaintext, health only
        self.health_port: int | None = None
        self.service_names: list[str] = []
        self.port: int | None = None

    def add_service(self, register: Callable[[Any, grpc.aio.Server], None], servicer: Any,
                    service_name: str) -> None:
        """``register`` is the generated ``add_<Name>Servicer_to_server``; ``service_name`` the
        full proto name (``"kvwire.v1.DecodeService"``), used by health and reflection."""
        register(servicer, self.server)
        self.service_names.append(service_name)

    async def _set_all(self, status: int) -> None:
        for name in (health.OVERALL_HEALTH, *self.service_names):
            await self.health.set(name, status)

    async def start(self, listen: str) -> int:
        """Bind ``listen`` (``host:port``; port 0 picks one), start, and return the bound port."""
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.reflection:
            reflection.enable_server_reflection(
                (*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        creds = self.security.credentials()
        self.port = self.server.add_secure_port(listen, creds) if creds is not None \
            else self.server.add_insecure_port(listen)
        if self.port == 0:
            raise errors.Unavailable(f"could not bind {listen}")
        if self.security.health_listen:
            self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = self.health_server.add_insecure_port(self.security.health_listen)
            if self.health_port == 0:
                raise errors.Unavailable(f"could not bind {self.security.health_listen}")
            await self.health_server.start()
        await self.server.start()
        log.info("listening on %s (port %d, %s%s): %s", listen, self.port,
                 "mTLS" if self.security.client_ca_file else "TLS" if creds else "plaintext",
                 ", tokens" if self.security.tokens_file else "", ", ".join(self.service_names))
        return self.port

    async def set_serving(self) -> None:
        """Call once the service has loaded and warmed up: health flips to SERVING.

        What startup built (torch, the model, the servicers) is moved out of reach of Python's
        cyclic garbage collector first (``gc.freeze``): it lives as long as the process, and a full
        collection walking it was about a tenth of prefill_svc's time over its first 1,024-token
        prompts (perf, SmolLM2-135M-Instruct)."""
        gc.collect()
        gc.freeze()
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)

    async def set_not_serving(self) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace_s: float, drain_delay_s: float = 0.0) -> None:
        """NOT_SERVING for good, wait ``drain_delay_s`` for load balancers to notice, then refuse
        new calls and give in-flight ones ``grace_s`` seconds before cancelling them."""
        await self.health.enter_graceful_shutdown()
        if drain_delay_s > 0:
            log.info("NOT_SERVING; still accepting calls for %.1f s while load balancers notice", drain_delay_s)
            await asyncio.sleep(drain_delay_s)
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)

    async def serve_until_signal(self, grace_s: float = 30.0, drain_delay_s: float = 0.0,
                                 signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        """Serve until one of ``signals`` arrives, then drain and stop."""
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        for sig in signals:
            loop.add_signal_handler(sig, stopping.set)
        try:
            # Only the event: cancelling a wait_for_termination() waiter would cancel the
            # server's own shutdown future and break stop().
            await stopping.wait()
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
        log.info("shutting down: NOT_SERVING for %.1f s, then draining for up to %.1f s", drain_delay_s, grace_s)
        await self.stop(grace_s, drain_delay_s)
