"""``python -m prefill_svc``: serve PrefillService (quantized prompt forward, FP8 KV pages out).

Flags: docs/configuration.md (declared in kvwire/args/sections.py).
"""
from __future__ import annotations

import asyncio
import logging

from kvwire import metrics
from kvwire.args import EngineArgs, parse_args
from kvwire.model import gguf
from kvwire.model.source import eos_token_ids
from kvwire.runtime import load_runtime
from kvwire_serving import cli, security
from kvwire_serving.cores import compute_executor
from kvwire_serving.lazy import Lazy
from kvwire_serving.server import GrpcServer
from kvwire_serving.telemetry import setup_tracing, start_metrics_server
from prefill_svc.runner import PrefillRunner
from prefill_svc.server import PrefillServicer
from protos.kvwire.v1 import kvwire_pb2_grpc

log = logging.getLogger("prefill_svc")


async def serve(args: EngineArgs) -> None:
    telemetry = setup_tracing("kvwire-prefill")
    start_metrics_server(telemetry, args.serving.metrics_port, security.metrics_host(args.serving))
    server = GrpcServer(security=security.server_security(args.security), reflection=not args.serving.no_reflection)
    threads = cli.set_threads(args.compute)
    lazy = Lazy(PrefillServicer, "prefill_svc")
    server.add_service(kvwire_pb2_grpc.add_PrefillServiceServicer_to_server, lazy, "kvwire.v1.PrefillService")
    port = await server.start(args.serving.listen)
    log.info("loading %s (weights %s, KV %s, %d compute threads) ...", args.model.model_dir,
             args.model.weights.value, args.cache.kv_dtype.value, threads)
    compute, loop = compute_executor("prefill"), asyncio.get_running_loop()  # every torch call on one thread
    runtime = await loop.run_in_executor(compute, load_runtime, args.runtime_config())
    runner = PrefillRunner(runtime, args.cache.num_pages, prefix_caching=args.cache.prefix_caching,
                           cores=cli.core_share(args.compute, "prefill", threads))
    metrics.watch_pool(runner.stats)  # KV pool use
    await loop.run_in_executor(compute, runner.warm_up)
    gguf.forget_readers()  # everything read from a GGUF model file is loaded by now
    lazy.set(PrefillServicer(runner, compute, eos_token_ids(args.model.model_dir, runtime.model_config)))
    await server.set_serving()
    log.info("prefill_svc SERVING on port %d", port)
    try:
        await server.serve_until_signal(grace_s=args.serving.grace_s, drain_delay_s=args.serving.drain_delay_s)
    finally:
        telemetry.shutdown()


def main(argv: list[str] | None = None) -> None:
    args = parse_args("prefill_svc", argv, description=__doc__.split("\n\n")[0])
    cli.setup_logging(args.serving.log_level)
    cli.run_service("prefill_svc", serve(args))


if __name__ == "__main__":
    main()
