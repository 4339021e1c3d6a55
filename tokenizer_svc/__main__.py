"""``python -m tokenizer_svc --model-dir models/kvwire-tiny --listen 127.0.0.1:50051
--decode-addr 127.0.0.1:50052``

Tracing is configured by the standard OTEL_* variables (see kvwire_serving.telemetry).
"""
from __future__ import annotations

import argparse
import logging
import ssl
from pathlib import Path

from kvwire_serving import security

from kvwire_serving.cli import run_service
from kvwire_serving.server import GrpcServer, build_channel
from kvwire_serving.telemetry import Telemetry, setup_tracing, start_metrics_server
from kvwire.tokenizer import ModelTokenizer
from protos.kvwire.v1 import kvwire_pb2_grpc as pb_grpc
from tokenizer_svc.openai_http import OpenAIHttpServer
from tokenizer_svc.routing import POLICIES, PrefixRouter, RoutingConfig, replica_security
from tokenizer_svc.server import (DEFAULT_FRONT_DOOR_MESSAGE_BYTES, DEFAULT_MAX_PROMPT_BYTES, DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_TOKENIZE_WORKERS,
                                  SERVICE_NAME, PromptLimits, TokenizerServiceConfig, TokenizerServicer)

log = logging.getLogger("tokenizer_svc")


def parse_args(argv: list[str] | None = None) -> TokenizerServiceConfig:
    p = argparse.ArgumentParser(prog="python -m tokenizer_svc", description=__doc__.split("\n\n")[-1])
    p.add_argument("--model-dir", default=str(Path(__file__).resolve().parents[1] / "models" / "kvwire-tiny"),
                   help="directory with tokenizer.json (+ tokenizer_config.json), a .gguf file or a directory holding one, "
                        "or a fetched model's name; default: the embedded model")
    p.add_argument("--listen", default="127.0.0.1:50051", help="host:port to serve on")
    p.add_argument("--decode-addr", default="127.0.0.1:50052",
                   help="DecodeService target, host:port or dns:///name:port (round-robin)")
    p.add_argument("--model-name", default="", help="model name for traces (default: the dir's name)")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_FRONT_DOOR_MESSAGE_BYTES,
                   help="largest gRPC message and HTTP body accepted; larger ones are refused before parsing "
                        "(gRPC: RESOURCE_EXHAUSTED; HTTP: 413). Prompts up to it but over --max-prompt-bytes get "
                        "INVALID_ARGUMENT")
    p.add_argument("--grace-s", type=float, default=30.0, help="drain time for in-flight calls at SIGTERM")
    p.add_argument("--max-prompt-bytes", type=int, default=DEFAULT_MAX_PROMPT_BYTES,
                   help="larger prompts (UTF-8 bytes of the text or chat contents) are refused before tokenizing")
    p.add_argument("--max-prompt-tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS,
                   help="prompts tokenizing to more tokens are refused")
    p.add_argument("--tokenize-workers", type=int, default=DEFAULT_TOKENIZE_WORKERS,
                   help="prompts tokenized at once (off the event loop); the others wait their turn")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (off if unset)")
    p.add_argument("--http-listen", default=None, metavar="HOST:PORT",
                   help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                        "/v1/models) on HOST:PORT, e.g. 127.0.0.1:8000; off if unset. Its model id is --model-name")
    security.add_serving_args(p, peers=("decode",))
    # ---- decode routing (tokenizer_svc/routing.py) -------------------------------------------
    p.add_argument("--decode-routing", choices=POLICIES, default=RoutingConfig.policy,
                   help="round_robin: gRPC spreads calls over --decode-addr's addresses; prefix: one channel "
                        "per decode replica and consistent hashing on the prompt's first KV page (bounded "
                        "load), so prompts sharing a prefix reach the replica whose prefix cache holds it")
    p.add_argument("--decode-routing-load-factor", type=float, default=RoutingConfig.load_factor,
                   help="prefix routing: a replica takes at most this x the mean in-flight load (>= 1)")
    # ---- end decode routing ---------------------------------------------------------------------
    a = p.parse_args(argv)
    if a.decode_routing_load_factor < 1:
        p.error("--decode-routing-load-factor must be >= 1")
    return TokenizerServiceConfig(
        model_dir=a.model_dir, listen=a.listen, decode_addr=a.decode_addr,
        model_name=a.model_name or Path(a.model_dir).resolve().name,
        max_message_bytes=a.max_message_bytes, grace_s=a.grace_s, drain_delay_s=a.drain_delay_s,
        metrics_port=a.metrics_port, metrics_host=security.metrics_host(a), http_listen=a.http_listen,
        max_prompt_bytes=a.max_prompt_bytes, max_prompt_tokens=a.max_prompt_tokens,
        tokenize_workers=a.tokenize_workers, reflection=not a.no_reflection,
        security=security.server_security(a), decode_security=security.client_security(a, "decode"),
        routing=RoutingConfig(policy=a.decode_routing, load_factor=a.decode_routing_load_factor))


async def serve(cfg: TokenizerServiceConfig, telemetry: Telemetry) -> None:
    server = GrpcServer(max_message_bytes=cfg.max_message_bytes, security=cfg.security, reflection=cfg.reflection)
    channel = build_channel(cfg.decode_addr, security=cfg.decode_security)  # the default (8 MiB) limit
    replica = replica_security(cfg.decode_addr, cfg.decode_security)
    router = PrefixRouter(cfg.decode_addr, lambda addr: build_channel(addr, security=replica),
                          cfg.routing) if cfg.routing.policy == "prefix" else None
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
                                ssl_context=http_ssl_context(cfg.security))
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


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = parse_args(argv)
    telemetry = setup_tracing("kvwire-tokenizer")
    try:
        run_service("tokenizer_svc", serve(cfg, telemetry))  # a bad model path: one line, exit 1
    finally:
        telemetry.shutdown()


if __name__ == "__main__":
    main()
