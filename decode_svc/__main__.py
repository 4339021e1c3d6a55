"""``python -m decode_svc``: serve DecodeService (admission, KV pull, continuous batching)."""
from __future__ import annotations

import argparse
import asyncio
import logging

from core import cli
from core.lazy import Lazy
from core.runtime import load_engine
from core.serving import GrpcServer, build_channel
from core.telemetry import setup_tracing, start_metrics_server
from core.tokenizer import ModelTokenizer
from decode_svc.engine import DecodeEngine
from decode_svc.runner import DecodeRunner
from decode_svc.scheduler import Scheduler, SchedulerConfig
from decode_svc.server import DecodeServicer
from protos import kvwire_pb2_grpc

log = logging.getLogger("decode_svc")


async def serve(args: argparse.Namespace) -> None:
    telemetry = setup_tracing("kvwire-decode")
    start_metrics_server(telemetry, args.metrics_port)
    server = GrpcServer()
    lazy = Lazy(DecodeServicer, "decode_svc")
    server.add_service(kvwire_pb2_grpc.add_DecodeServiceServicer_to_server, lazy, "kvwire.v1.DecodeService")
    port = await server.start(args.listen)
    engine_cfg = cli.engine_config(args)
    log.info("loading %s (weights %s, KV %s) ...", engine_cfg.model_dir, engine_cfg.weights.value,
             engine_cfg.kv_dtype.value)
    engine = await asyncio.to_thread(load_engine, engine_cfg)
    eos = ModelTokenizer(engine_cfg.model_dir).eos_ids | set(engine.model_config.eos_token_ids)
    runner = DecodeRunner(engine, engine_cfg.num_pages)
    await asyncio.to_thread(runner.warm_up)
    scheduler = Scheduler(SchedulerConfig(total_pages=engine_cfg.num_pages, block_size=engine_cfg.block_size,
                                          max_waiting=args.max_waiting, max_running=args.max_running,
                                          sliding_window=engine.model_config.sliding_window))
    channel = build_channel(args.prefill_addr)
    decode = DecodeEngine(runner, scheduler, kvwire_pb2_grpc.PrefillServiceStub(channel), eos)
    decode.start()
    lazy.set(DecodeServicer(decode))
    await server.set_serving()
    log.info("decode_svc SERVING on port %d (prefill at %s)", port, args.prefill_addr)
    try:
        await server.serve_until_signal(grace_s=args.grace_s)
    finally:
        await decode.close()
        await channel.close()
        telemetry.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m decode_svc", description=__doc__)
    cli.add_engine_args(ap, default_pages=2048)
    cli.add_server_args(ap, default_listen="127.0.0.1:50052")
    ap.add_argument("--prefill-addr", default="127.0.0.1:50053",
                    help="prefill_svc address: host:port, or dns:///name:port for several replicas")
    ap.add_argument("--max-running", type=int, default=16, help="requests decoded together at most")
    ap.add_argument("--max-waiting", type=int, default=64, help="queued requests before RESOURCE_EXHAUSTED")
    args = ap.parse_args()
    cli.setup_logging(args.log_level)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
