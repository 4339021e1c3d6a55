"""``python -m prefill_svc``: serve PrefillService (quantized prompt forward, FP8 KV pages out)."""
from __future__ import annotations

import argparse
import asyncio
import logging

from kvwire import metrics
from kvwire_serving import cli, security
from kvwire_serving.cores import compute_executor
from kvwire_serving.lazy import Lazy
from kvwire.model import gguf
from kvwire.runtime import load_engine
from kvwire_serving.server import GrpcServer
from kvwire_serving.telemetry import setup_tracing, start_metrics_server
from prefill_svc.runner import PrefillRunner
from prefill_svc.server import PrefillServicer
from protos.kvwire.v1 import kvwire_pb2_grpc

log = logging.getLogger("prefill_svc")


async def serve(args: argparse.Namespace) -> None:
    telemetry = setup_tracing("kvwire-prefill")
    start_metrics_server(telemetry, args.metrics_port, security.metrics_host(args))
    server = GrpcServer(security=security.server_security(args), reflection=not args.no_reflection)
    engine_cfg = cli.engine_config(args)
    threads = cli.set_threads(args)
    lazy = Lazy(PrefillServicer, "prefill_svc")
    server.add_service(kvwire_pb2_grpc.add_PrefillServiceServicer_to_server, lazy, "kvwire.v1.PrefillService")
    port = await server.start(args.listen)
    log.info("loading %s (weights %s, KV %s, %d compute threads) ...", engine_cfg.model_dir,
             engine_cfg.weights.value, engine_cfg.kv_dtype.value, threads)
    compute, loop = compute_executor("prefill"), asyncio.get_running_loop()  # every torch call on one thread
    engine = await loop.run_in_executor(compute, load_engine, engine_cfg)
    runner = PrefillRunner(engine, engine_cfg.num_pages, prefix_caching=args.prefix_caching,
                           cores=cli.core_share(args, "prefill", threads))
    metrics.watch_pool(runner.stats)  # KV pool use
    await loop.run_in_executor(compute, runner.warm_up)
    gguf.forget_readers()  # everything read from a GGUF model file is loaded by now
    lazy.set(PrefillServicer(runner, compute))
    await server.set_serving()
    log.info("prefill_svc SERVING on port %d", port)
    try:
        await server.serve_until_signal(grace_s=args.grace_s, drain_delay_s=args.drain_delay_s)
    finally:
        telemetry.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m prefill_svc", description=__doc__)
    cli.add_engine_args(ap, default_pages=1024)
    cli.add_server_args(ap, default_listen="127.0.0.1:50053")
    security.add_serving_args(ap)
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                    help="keep full prompt pages (named by a sha256 chain of their tokens) and reuse them "
                         "for later prompts with the same prefix; evicted LRU when the pool runs short")
    args = ap.parse_args()
    cli.setup_logging(args.log_level)
    cli.run_service("prefill_svc", serve(args))


if __name__ == "__main__":
    main()
