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
import functools
import json
import logging
import ssl
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, AsyncIterator

import grpc
from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from kvwire import errors, metrics
from kvwire_serving.security import TokenSet
from protos.kvwire.v1 import kvwire_pb2 as pb
from tokenizer_svc.openai_errors import OpenAIError, invalid, model_not_found
from tokenizer_svc.openai_logprobs import CompletionLogprobs, chat_logprobs
from tokenizer_svc.openai_protocol import (FINISH_REASONS, ParsedRequest, Responder, model_card, models_list,
                                           parse_json, parse_request, total_usage)
from tokenizer_svc.openai_sampling import unknown_fields
from tokenizer_svc.openai_tools import ToolReply, call_dict
from tokenizer_svc.server import TokenizerServicer

log = logging.getLogger(__name__)
LogprobsFormat = Callable[[Sequence[pb.TokenLogprob]], dict]  # a request's logprobs -> its response shape
UNTRACED_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapes would flood the trace backend


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


def echoed(parsed: ParsedRequest, first: pb.GenerateTextResponse, fmt: LogprobsFormat | None
           ) -> tuple[str, dict | None]:
    """The prompt's text and logprobs when a completions request asked for ``echo`` ("" and None
    otherwise); ``first``: the pipeline's first message (it carries the prompt's tokens and logprobs)."""
    if not parsed.echo:
        return "", None
    if not isinstance(fmt, CompletionLogprobs):
        return parsed.request.text, None
    return parsed.request.text, fmt.prompt(first.prompt_token_ids, first.prompt_logprobs)


def best_first(logprobs: list[list[pb.TokenLogprob]]) -> list[int]:
    """Choice indices by cumulative logprob of their tokens (raw log_softmax, summed), highest
    first; ties keep the lower index first."""
    return sorted(range(len(logprobs)), key=lambda i: -sum(e.logprob for e in logprobs[i]))


async def first_piece(pieces: AsyncIterator[pb.GenerateTextResponse], parsed: ParsedRequest
                      ) -> pb.GenerateTextResponse:
    """The pipeline's first message; a constraint decode could not compile is a 400 naming the
    param that set it (decode says INVALID_ARGUMENT "structured output ...")."""
    try:
        return await anext(pieces)
    except Exception as e:
        err = OpenAIError.from_exception(e)
        if parsed.structured_param and err.status == 400 and err.message.startswith("structured output"):
            raise invalid(err.message, parsed.structured_param) from e
        raise


class OpenAIHttpServer:
    """The aiohttp app and its listener; ``start`` inside the running grpc.aio event loop."""

    def __init__(self, servicer: TokenizerServicer, model: str, *, max_body_bytes: int = 8 << 20,
                 grace_s: float = 30.0, tracer_provider: trace.TracerProvider | None = None,
                 tokens: TokenSet | None = None, ssl_context: ssl.SSLContext | None = None,
                 cors_origins: tuple[str, ...] = (), metrics: bool = False):
        self.servicer = servicer
        self.model_id = model
        self.created = int(time.time())
        self.grace_s = grace_s
        self.tracer = trace.get_tracer("kvwire.tokenizer_svc.http", tracer_provider=tracer_provider)
        self.tokens = tokens  # None: no bearer token needed
        self.ssl_context = ssl_context  # None: plain HTTP
        self.cors_origins = frozenset(cors_origins)  # empty: no CORS headers, preflights are 405 as before
        self.app = web.Application(client_max_size=max_body_bytes,
                                   middlewares=[self._count, self._cors, self._trace, self._errors, self._auth])
        if self.cors_origins:
            self.app.on_response_prepare.append(self._with_cors)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/models/{model}", self.get_model)
        self.app.router.add_get("/health", self.health)
        if metrics:
            self.app.router.add_get("/metrics", self.metrics)
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
    async def _count(self, request: web.Request, handler) -> web.StreamResponse:
        """Every request in kvwire:http_requests_total by route template (never the raw path: bounded
        label values), method and the status sent; 499 when the client left first."""
        resource = request.match_info.route.resource
        route = (resource.canonical if resource is not None else None) or "unmatched"
        status = "499"
        try:
            response = await handler(request)
            status = str(response.status)
            return response
        finally:
            metrics.HTTP_REQUESTS.labels(route, request.method, status).inc()

    def _cors_headers(self, request: web.Request) -> dict[str, str]:
        """Access-Control-Allow-Origin for a request from an allowed origin (--cors-allowed-origins), else none."""
        origin = request.headers.get("Origin")
        if origin is None or not ("*" in self.cors_origins or origin in self.cors_origins):
            return {}
        return {"Access-Control-Allow-Origin": "*" if "*" in self.cors_origins else origin, "Vary": "Origin"}

    async def _with_cors(self, request: web.Request, response: web.StreamResponse) -> None:
        """on_response_prepare: every response to an allowed origin, streamed ones included, says so."""
        response.headers.update(self._cors_headers(request))

    @web.middleware
    async def _cors(self, request: web.Request, handler) -> web.StreamResponse:
        """A CORS preflight (OPTIONS with Access-Control-Request-Method) from an allowed origin is
        answered here, before auth: browsers send no credentials on it."""
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers \
                and self._cors_headers(request):
            return web.Response(status=204, headers={
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS", "Access-Control-Max-Age": "600",
                "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers",
                                                                    "Authorization, Content-Type")})
        return await handler(request)

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

    async def metrics(self, request: web.Request) -> web.Response:
        """The process's Prometheus registry, as the --metrics-port listener serves it."""
        body = generate_latest(REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

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
        body = parse_json(await request.read())
        parsed = parse_request(body, chat, self.model_id, request_id, self.servicer.tok.sampling_defaults)
        if ignored := unknown_fields(body):
            log.warning("%s %s: ignoring fields that are neither OpenAI's nor vLLM's: %s", request.method,
                        request.path, ", ".join(ignored))
        if chat and not self.servicer.tok.chat_template:
            raise invalid(f"the model {self.model_id} has no chat template; use /v1/completions with a prompt",
                          "messages", "no_chat_template")
        responder = Responder(chat, self.model_id, request_id)
        # aclosing: leaving early (disconnect, error) closes the pipeline now, which cancels decode.
        try:
            async with contextlib.aclosing(self.servicer.generate_text(parsed.request, None)) as pieces:
                # The first piece comes before any byte is sent, so errors found up to the first token
                # (bad prompt, context too long, decode down) still get their own HTTP status.
                first = await first_piece(pieces, parsed)
                fmts = [self._logprobs_format(parsed) for _ in range(parsed.best_of or parsed.n)]  # per choice
                if not parsed.stream:
                    return await self._whole(parsed, first, pieces, responder, fmts)
                return await self._stream(request, parsed, first, pieces, responder, fmts)
        finally:
            self.servicer.reclaim_after(parsed.request)  # a large body's memory back (tokenizer_svc/memory.py)

    def _logprobs_format(self, parsed: ParsedRequest) -> LogprobsFormat | None:
        """How this request's logprobs are written (None: not asked for)."""
        if parsed.logprobs is None:
            return None
        tok = self.servicer.tok

        def text_of(token_id: int) -> str:
            return tok.decode([token_id], skip_special_tokens=False)
        return functools.partial(chat_logprobs, text_of) if parsed.chat else CompletionLogprobs(text_of)

    @staticmethod
    async def _whole(parsed: ParsedRequest, first: pb.GenerateTextResponse,
                     rest: AsyncIterator[pb.GenerateTextResponse], responder: Responder,
                     fmts: list[LogprobsFormat | None]) -> web.Response:
        """Every choice's pieces gathered by index (n > 1: they arrive interleaved); with best_of,
        the n of highest cumulative logprob, best first (vLLM's order)."""
        n = parsed.best_of or parsed.n
        texts: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list[pb.TokenLogprob]] = [[] for _ in range(n)]
        lasts: list[pb.GenerateTextResponse | None] = [None] * n
        piece: pb.GenerateTextResponse | None = first
        while piece is not None:
            texts[piece.index].append(piece.text)
            logprobs[piece.index] += piece.logprobs
            if piece.finish_reason:
                lasts[piece.index] = piece
            piece = await anext(rest, None)
        order = range(n) if parsed.best_of is None else best_first(logprobs)[:parsed.n]
        choices = []
        for i in order:
            fmt = fmts[i]
            prompt_text, prompt_lps = echoed(parsed, first, fmt)
            completion_lps = fmt(logprobs[i]) if fmt is not None else None
            if prompt_lps is not None:
                completion_lps = CompletionLogprobs.joined(prompt_lps, completion_lps)
            finish = lasts[i].finish_reason if lasts[i] else 0
            if parsed.tools is None:
                choices.append((prompt_text + "".join(texts[i]), finish, completion_lps))
                continue
            reply = ToolReply(parsed.tools)
            content, calls = reply.final("".join(texts[i]))
            choices.append((content, reply.finish_reason(calls, FINISH_REASONS.get(finish)), completion_lps,
                            [call_dict(c) for c in calls]))
        return _json(responder.full(choices, total_usage([lasts[i] for i in order if lasts[i] is not None])),
                     headers={"X-Request-Id": responder.request_id})

    @staticmethod
    async def _stream(request: web.Request, parsed: ParsedRequest, first: pb.GenerateTextResponse,
                      rest: AsyncIterator[pb.GenerateTextResponse], responder: Responder,
                      fmts: list[LogprobsFormat | None]) -> web.StreamResponse:
        """Chunks carry their choice's index; each choice ends with a chunk of its finish reason."""
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
            "X-Request-Id": responder.request_id})
        await response.prepare(request)
        try:
            for i, fmt in enumerate(fmts):
                if parsed.chat:
                    await response.write(_sse(responder.chunk(None, first=True, index=i)))
                prompt_text, prompt_lps = echoed(parsed, first, fmt)
                if parsed.echo:  # the prompt first, as vLLM streams it
                    await response.write(_sse(responder.chunk(prompt_text, logprobs=prompt_lps, index=i)))
            piece, lasts = first, []
            replies = {i: ToolReply(parsed.tools) for i in range(len(fmts))} if parsed.tools is not None else {}
            while piece is not None:
                i, fmt = piece.index, fmts[piece.index]
                reply = replies.get(i)
                text, deltas = reply.piece(piece.text) if reply is not None else (piece.text, [])
                if text or deltas or (fmt is not None and piece.logprobs):  # text held back: its logprobs still go
                    await response.write(_sse(responder.chunk(text, logprobs=fmt(piece.logprobs)
                                                              if fmt is not None else None, index=i,
                                                              tool_calls=deltas)))
                if piece.finish_reason:
                    lasts.append(piece)
                    reason: int | str | None = piece.finish_reason
                    if reply is not None:  # the calls held back (auto) go now
                        tail, deltas, calls = reply.end()
                        if tail or deltas:
                            await response.write(_sse(responder.chunk(tail, index=i, tool_calls=deltas)))
                        reason = reply.finish_reason(calls, FINISH_REASONS.get(piece.finish_reason))
                    await response.write(_sse(responder.chunk(None, reason, index=i)))
                piece = await anext(rest, None)
            if parsed.include_usage and lasts:
                await response.write(_sse(responder.usage_chunk(total_usage(lasts))))
        except ConnectionError:
            return response  # the client left; closing the pipeline (our caller) cancels decode
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band, as vLLM does
            err = OpenAIError.from_exception(e)
            log.info("%s %s failed mid-stream -> %d: %s", request.method, request.path, err.status, err.message)
            await response.write(_sse(err.body()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
