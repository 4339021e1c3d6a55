"""decode_svc assembled from its ``EngineArgs``: the engine (``build_engine``), the KV sources (local,
and remote prefill when --prefill-addr is set), readiness, and the gRPC server around them."""
from __future__ import annotations

import asyncio
import logging

from decode_svc.readiness import PrefillWatch
from decode_svc.remote_prefill import RemotePrefill
from decode_svc.server import DecodeServicer
from kvwire import metrics
from kvwire.args import EngineArgs
from kvwire.engine.async_engine import AsyncEngine
from kvwire.engine.build import build_engine
from kvwire.engine.kv_source import KVSourcePolicy, KVSources, LocalPrefill
from kvwire_serving import cli, security
from kvwire_serving.cores import compute_executor
from kvwire_serving.lazy import Lazy
from kvwire_serving.server import GrpcServer, build_channel
from kvwire_serving.telemetry import setup_tracing, start_metrics_server
from protos.kvwire.v1 import kvwire_pb2_grpc

log = logging.getLogger("decode_svc")


def kv_source_policy(args: EngineArgs) -> KVSourcePolicy:
    k = args.kv_source
    return KVSourcePolicy(local_when_idle=k.local_prefill_when_idle, local_max_tokens=k.local_prefill_max_tokens,
                          local_max_decoding=k.local_prefill_max_decoding,
                          remote_max_inflight=k.remote_prefill_max_inflight)


async def serve(args: EngineArgs) -> None:
    telemetry = setup_tracing("kvwire-decode")
    start_metrics_server(telemetry, args.serving.metrics_port, security.metrics_host(args.serving))
    server = GrpcServer(security=security.server_security(args.security), reflection=not args.serving.no_reflection)
    lazy = Lazy(DecodeServicer, "decode_svc")
    server.add_service(kvwire_pb2_grpc.add_DecodeServiceServicer_to_server, lazy, "kvwire.v1.DecodeService")
    port = await server.start(args.serving.listen)
    threads = cli.set_threads(args.compute)
    log.info("loading %s (weights %s, KV %s, %d compute threads) ...", args.model.model_dir,
             args.model.weights.value, args.cache.kv_dtype.value, threads)
    compute, loop = compute_executor("engine"), asyncio.get_running_loop()  # every torch call on one thread
    core = await loop.run_in_executor(compute, lambda: build_engine(args, warm_up=True))
    runner, k = core.runner, args.kv_source
    # Without --prefill-addr every prompt prefills here; with it, KVSources picks per request.
    channel = build_channel(k.prefill_addr, security=security.client_security(args.peer)) if k.prefill_addr else None
    remote = RemotePrefill(runner, kvwire_pb2_grpc.PrefillServiceStub(channel), channel,
                           transfer_timeout_s=k.kv_transfer_timeout_s) if channel else None
    watch = PrefillWatch(channel, remote, server if k.readiness_follows_prefill else None,
                         k.prefill_health_interval_s) if remote else None
    decode = AsyncEngine(core, KVSources(LocalPrefill(runner), remote, kv_source_policy(args)),
                         cores=cli.core_share(args.compute, "decode", threads), executor=compute)
    decode.start()
    metrics.watch_pool(decode.stats)  # running/waiting requests, KV pool use
    lazy.set(DecodeServicer(decode))
    first = await watch.first_check() if watch else True  # before SERVING: remote on from the first request
    await server.set_serving()
    if watch:
        await watch.start(first)
    log.info("decode_svc SERVING on port %d (prefill at %s)", port, k.prefill_addr or "none: local only")
    try:
        await server.serve_until_signal(grace_s=args.serving.grace_s, drain_delay_s=args.serving.drain_delay_s)
    finally:
        if watch:
            await watch.close()
        await decode.close()
        if channel is not None:
            await channel.close()
        telemetry.shutdown()
