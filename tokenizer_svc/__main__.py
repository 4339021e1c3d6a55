"""``python -m tokenizer_svc --model-dir models/kvwire-tiny --listen 127.0.0.1:50051
--decode-addr 127.0.0.1:50052``

Tracing is configured by the standard OTEL_* variables (see kvwire.telemetry).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from kvwire.serving import DEFAULT_MAX_MESSAGE_BYTES, GrpcServer, build_channel
from kvwire.telemetry import Telemetry, setup_tracing, start_metrics_server
from kvwire.tokenizer import ModelTokenizer
from protos import kvwire_pb2_grpc as pb_grpc
from tokenizer_svc.server import SERVICE_NAME, TokenizerServiceConfig, TokenizerServicer

log = logging.getLogger("tokenizer_svc")


def parse_args(argv: list[str] | None = None) -> TokenizerServiceConfig:
    p = argparse.ArgumentParser(prog="python -m tokenizer_svc", description=__doc__.split("\n\n")[-1])
    p.add_argument("--model-dir", default=str(Path(__file__).resolve().parents[1] / "models" / "kvwire-tiny"),
                   help="directory with tokenizer.json (+ tokenizer_config.json); default: the embedded model")
    p.add_argument("--listen", default="127.0.0.1:50051", help="host:port to serve on")
    p.add_argument("--decode-addr", default="127.0.0.1:50052",
                   help="DecodeService target, host:port or dns:///name:port (round-robin)")
    p.add_argument("--model-name", default="", help="model name for traces (default: the dir's name)")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    p.add_argument("--grace-s", type=float, default=30.0, help="drain time for in-flight calls at SIGTERM")
    p.add_argument("--drain-delay-s", type=float, default=0.0,
                   help="seconds NOT_SERVING before refusing new calls (let load balancers notice)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (off if unset)")
    a = p.parse_args(argv)
    return TokenizerServiceConfig(
        model_dir=a.model_dir, listen=a.listen, decode_addr=a.decode_addr,
        model_name=a.model_name or Path(a.model_dir).resolve().name,
        max_message_bytes=a.max_message_bytes, grace_s=a.grace_s, drain_delay_s=a.drain_delay_s,
        metrics_port=a.metrics_port)


async def serve(cfg: TokenizerServiceConfig, telemetry: Telemetry) -> None:
    server = GrpcServer(max_message_bytes=cfg.max_message_bytes)
    channel = build_channel(cfg.decode_addr, max_message_bytes=cfg.max_message_bytes)
    tokenizer = ModelTokenizer(cfg.model_dir)
    servicer = TokenizerServicer(tokenizer, pb_grpc.DecodeServiceStub(channel), cfg.model_name)
    server.add_service(pb_grpc.add_TokenizerServiceServicer_to_server, servicer, SERVICE_NAME)
    port = await server.start(cfg.listen)
    tokenizer.encode("warm up the tokenizer: 안녕하세요 👋")
    start_metrics_server(telemetry, cfg.metrics_port)
    await server.set_serving()
    log.info("tokenizer_svc serving %s on port %d, decode at %s", cfg.model_name, port, cfg.decode_addr)
    try:
        await server.serve_until_signal(cfg.grace_s, cfg.drain_delay_s)
    finally:
        await channel.close()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = parse_args(argv)
    telemetry = setup_tracing("tokenizer_svc")
    try:
        asyncio.run(serve(cfg, telemetry))
    finally:
        telemetry.shutdown()


if __name__ == "__main__":
    main()
