"""tokenizer_svc assembled from its ``EngineArgs``: the front door's config, the gRPC server and the
optional OpenAI-compatible HTTP door."""
from __future__ import annotations

import logging
import ssl
from pathlib import Path

from kvwire.args import EngineArgs
from kvwire.tokenizer import ModelTokenizer
from kvwire_serving import security
from kvwire_serving.server import GrpcServer, build_channel
from kvwire_serving.telemetry import Telemetry, start_metrics_server
from protos.kvwire.v1 import kvwire_pb2_grpc as pb_grpc
from tokenizer_svc.openai_http import OpenAIHttpServer
from tokenizer_svc.routing import PrefixRouter, RoutingConfig, replica_security
from tokenizer_svc.server import SERVICE_NAME, PromptLimits, TokenizerServiceConfig, TokenizerServicer

log = logging.getLogger("tokenizer_svc")


def service_config(args: EngineArgs) -> TokenizerServiceConfig:
    t, s = args.tokenizer, args.serving
    return TokenizerServiceConfig(
        model_dir=str(args.model.model_dir), listen=s.listen, decode_addr=t.decode_addr,
        model_name=t.model_name or Path(args.model.model_dir).resolve().name,
        max_message_bytes=t.max_message_bytes, grace_s=s.grace_s, drain_delay_s=s.drain_delay_s,
        metrics_port=s.metrics_port, metrics_host=security.metrics_host(s), http_listen=t.http_listen,
        cors_allowed_origins=tuple(o.strip() for o in t.cors_allowed_origins.split(",") if o.strip()),
        http_metrics=t.http_metrics,
        max_prompt_bytes=t.max_prompt_bytes, max_prompt_tokens=t.max_prompt_tokens,
        tokenize_workers=t.tokenize_workers, reflection=not s.no_reflection,
        security=security.server_security(args.security), decode_security=security.client_security(args.peer),
        routing=RoutingConfig(policy=t.decode_routing.value, load_factor=t.decode_routing_load_factor))


async def serve(cfg: TokenizerServiceConfig, telemetry: Telemetry) -> None:
    server = GrpcServer(max_message_bytes=cfg.max_message_bytes, security=cfg.security, reflection=cfg.reflection)
    # round_robin: one channel over --decode-addr's addresses; prefix: the router's channel per replica
    channel, router = None, None
    if cfg.routing.policy == "prefix":
        replica = replica_security(cfg.decode_addr, cfg.decode_security)
        router = PrefixRouter(cfg.decode_addr, lambda addr: build_channel(addr, security=replica), cfg.routing)
    else:
        channel = build_channel(cfg.decode_addr, security=cfg.decode_security)  # the default (8 MiB) limit
    tokenizer = ModelTokenizer(cfg.model_dir)
    limits = PromptLimits(cfg.max_prompt_bytes, cfg.max_prompt_tokens, cfg.tokenize_workers)
    servicer = TokenizerServicer(tokenizer, router or pb_grpc.DecodeServiceStub(channel), cfg.model_name, limits)
    server.add_service(pb_grpc.add_TokenizerServiceServicer_to_server, servicer, SERVICE_NAME)
    port = await server.start(cfg.listen)
    tokenizer.encode("warm up the tokenizer: 안녕하세요 👋")
    start_metrics_server(telemetry, cfg.metrics_port, cfg.metrics_host or "127.0.0.1")
    http = None
    if cfg.http_listen:  # bound before SERVING, so a ready front door has both doors open
        http = OpenAIHttpServer(servicer, cfg.model_name, max_body_bytes=cfg.max_message_bytes, grace_s=cfg.grace_s,
                                tokens=cfg.security.interceptor().tokens if cfg.security.tokens_file else None,
                                ssl_context=http_ssl_context(cfg.security), cors_origins=cfg.cors_allowed_origins,
                                metrics=cfg.http_metrics)
        await http.start(cfg.http_listen)
    if router is not None:
        await router.start()
    await server.set_serving()
    log.info("tokenizer_svc serving %s on port %d, decode at %s", cfg.model_name, port, cfg.decode_addr)
    try:
        await server.serve_until_signal(cfg.grace_s, cfg.drain_delay_s)
    finally:
        if http is not None:
            await http.stop()
        if router is not None:
            await router.close()
        if channel is not None:
            await channel.close()
        servicer.close()


def http_ssl_context(sec: security.ServerSecurity) -> ssl.SSLContext | None:
    """The HTTP door speaks TLS with the gRPC listener's certificate (and mTLS with its client CA)."""
    if not sec.tls:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(sec.cert_file, sec.key_file)
    if sec.client_ca_file:
        ctx.load_verify_locations(sec.client_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
