"""The OpenAI-compatible HTTP door of tokenizer_svc (``--http-listen``), in the gRPC server's event loop.

    POST /v1/chat/completions   POST /v1/completions   (stream true/false; server-sent events)
    GET  /v1/models             GET  /v1/models/{id}   GET /health

Requests run through the same pipeline as the gRPC ``GenerateText`` (chat template, tokenization,
stop strings, incremental detokenizer, the decode call): ``TokenizerServicer.generate_text``.
A client that disconnects cancels its handler (``handler_cancellation``), which closes the
pipeline and cancels the decode call, so decode and prefill free the request's pages.

Each request is one HTTP server span (HTTP semantic conventions; a W3C ``traceparent`` header is
honoured) that parents the tokenize span and the gRPC client span to decode, so one trace runs
HTTP -> decode -> prefill. Middlewares are the place for request-wide policy (auth, limits).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
import uuid
from typing import Any, AsyncIterator

import grpc
from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvwire import errors
from kvwire_serving.security import TokenSet
from protos.kvwire.v1 import kvwire_pb2 as pb
from tokenizer_svc.openai_errors import OpenAIError, invalid, model_not_found
from tokenizer_svc.openai_protocol import (ParsedRequest, Responder, model_card, models_list, parse_json,
                                           parse_request)
from tokenizer_svc.server import TokenizerServicer

log = logging.getLogger(__name__)
UNTRACED_PATHS = frozenset({"/health"})  # probes would flood the trace backend


def split_host_port(listen: str) -> tuple[str, int]:
    """``"127.0.0.1:8000"``, ``"[::1]:8000"``, ``"0.0.0.0:0"`` -> (host, port)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--http-listen wants host:port (e.g. 127.0.0.1:8000), got {listen!r}")
    return host.strip("[]"), int(port)


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(obj, status=status, headers=headers,
                             dumps=lambda o: json.dumps(o, ensure_ascii=False, separators=(",", ":")))


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class OpenAIHttpServer:
    """The aiohttp app and its listener; ``start`` inside the running grpc.aio event loop."""

    def __init__(self, servicer: TokenizerServicer, model: str, *, max_body_bytes: int = 8 << 20,
                 grace_s: float = 30.0, tracer_provider: trace.TracerProvider | None = None,
                 tokens: TokenSet | None = None, ssl_context: ssl.SSLContext | None = None):
        self.servicer = servicer
        self.model_id = model
        self.created = int(time.time())
        self.grace_s = grace_s
        self.tracer = trace.get_tracer("kvwire.tokenizer_svc.http", tracer_provider=tracer_provider)
        self.tokens = tokens  # None: no bearer token needed
        self.ssl_context = ssl_context  # None: plain HTTP
        self.app = web.Application(client_max_size=max_body_bytes,
                                   middlewares=[self._trace, self._errors, self._auth])
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/models/{model}", self.get_model)
        self.app.router.add_get("/health", self.health)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self, listen: str) -> int:
        """Bind ``listen`` (port 0 picks one) and serve; returns the bound port."""
        host, port = split_host_port(listen)
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=self.grace_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_port=False, ssl_context=self.ssl_context)
        try:
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            raise errors.Unavailable(f"could not bind --http-listen {listen}: {e.strerror or e}") from e
        self.port = self._runner.addresses[0][1]  # the real port when 0 was asked for
        log.info("OpenAI-compatible HTTP on http://%s:%d/v1 (model %s)", host, self.port, self.model_id)
        return self.port

    async def stop(self) -> None:
        """Stop listening, give in-flight requests up to ``grace_s``, then cancel them."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- middlewares (outermost first) ------------------------------------------------------------

    @web.middleware
    async def _trace(self, request: web.Request, handler) -> web.StreamResponse:
        if request.path in UNTRACED_PATHS:
            return await handler(request)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else None
        host, _, port = (request.host or "").rpartition(":")
        attrs = {"http.request.method": request.method, "url.path": request.path, "url.scheme": request.scheme,
                 "network.protocol.version": f"{request.version.major}.{request.version.minor}",
                 "user_agent.original": request.headers.get("User-Agent", ""),
                 "client.address": request.remote or ""}
        if route:
            attrs["http.route"] = route
        if port.isdigit():
            attrs.update({"server.address": host.strip("[]"), "server.port": int(port)})
        name = f"{request.method} {route}" if route else request.method
        parent = propagate.extract(request.headers)  # a caller's W3C traceparent, if any
        with self.tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER, attributes=attrs,
                                               set_status_on_exception=False) as span:
            try:
                response = await handler(request)
            except asyncio.CancelledError:
                span.set_attribute("kvwire.client_disconnected", True)
                raise
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 500:
                span.set_attribute("error.type", str(response.status))
                span.set_status(Status(StatusCode.ERROR))
            return response

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every error leaves as OpenAI's JSON shape with a matching status."""
        try:
            return await handler(request)
        except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body too large
            if e.status < 400:
                raise
            err = OpenAIError(e.status, e.text or e.reason, "invalid_request_error", None, e.reason.lower()
                              .replace(" ", "_"))
        except Exception as e:  # noqa: BLE001 - mapped once, by kvwire's gRPC status mapping
            err = OpenAIError.from_exception(e)
            if err.code == "internal" and not isinstance(e, grpc.aio.AioRpcError):  # ours, unexpected
                log.error("%s %s -> %d", request.method, request.path, err.status, exc_info=e)
            else:
                log.info("%s %s -> %d: %s", request.method, request.path, err.status, err.message)
        return _json(err.body(), status=err.status)

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        """``Authorization: Bearer <token>`` from --auth-tokens-file on every route but /health."""
        if self.tokens is not None and request.path not in UNTRACED_PATHS:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise OpenAIError.from_grpc(grpc.StatusCode.UNAUTHENTICATED,
                                            "missing credentials: send 'Authorization: Bearer <token>'")
            if not self.tokens.accepts(token.strip()):
                raise OpenAIError.from_grpc(grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
        return await handler(request)

    # -- routes ------------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return _json(models_list(self.model_id, self.created))

    async def get_model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model_id:
            raise model_not_found(request.match_info["model"])
        return _json(model_card(self.model_id, self.created))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        request_id = uuid.uuid4().hex
        parsed = parse_request(parse_json(await request.read()), chat, self.model_id, request_id)
        if chat and not self.servicer.tok.chat_template:
            raise invalid(f"the model {self.model_id} has no chat template; use /v1/completions with a prompt",
                          "messages", "no_chat_template")
        responder = Responder(chat, self.model_id, request_id)
        # aclosing: leaving early (disconnect, error) closes the pipeline now, which cancels decode.
        try:
            async with contextlib.aclosing(self.servicer.generate_text(parsed.request, None)) as pieces:
                # The first piece comes before any byte is sent, so errors found up to the first token
                # (bad prompt, context too long, decode down) still get their own HTTP status.
                first = await anext(pieces)
                if not parsed.stream:
                    return await self._whole(first, pieces, responder)
                return await self._stream(request, parsed, first, pieces, responder)
        finally:
            self.servicer.reclaim_after(parsed.request)  # a large body's memory back (tokenizer_svc/memory.py)

    @staticmethod
    async def _whole(first: pb.GenerateTextResponse, rest: AsyncIterator[pb.GenerateTextResponse],
                     responder: Responder) -> web.Response:
        texts, last = [first.text], first
        async for piece in rest:
            texts.append(piece.text)
            last = piece if piece.finish_reason else last
        return _json(responder.full("".join(texts), last.finish_reason, last.usage),
                     headers={"X-Request-Id": responder.request_id})

    @staticmethod
    async def _stream(request: web.Request, parsed: ParsedRequest, first: pb.GenerateTextResponse,
                      rest: AsyncIterator[pb.GenerateTextResponse], responder: Responder) -> web.StreamResponse:
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
            "X-Request-Id": responder.request_id})
        await response.prepare(request)
        try:
            if parsed.chat:
                await response.write(_sse(responder.chunk(None, first=True)))
            piece, last = first, None
            while True:
                if piece.text:
                    await response.write(_sse(responder.chunk(piece.text)))
                if piece.finish_reason:
                    last = piece
                    await response.write(_sse(responder.chunk(None, piece.finish_reason)))
                piece = await anext(rest, None)
                if piece is None:
                    break
            if parsed.include_usage and last is not None:
                await response.write(_sse(responder.usage_chunk(last.usage)))
        except ConnectionError:
            return response  # the client left; closing the pipeline (our caller) cancels decode
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band, as vLLM does
            err = OpenAIError.from_exception(e)
            log.info("%s %s failed mid-stream -> %d: %s", request.method, request.path, err.status, err.message)
            await response.write(_sse(err.body()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
