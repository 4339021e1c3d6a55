"""``python -m decode_svc``: serve DecodeService (admission, KV pull, continuous batching)."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from pathlib import Path

from kvwire import metrics
from kvwire_serving import cli, security
from kvwire_serving.cores import compute_executor
from kvwire.config import KVDtype, QuantMode
from kvwire_serving.lazy import Lazy
from kvwire.runtime import load_engine
from kvwire.sampling_params import MAX_SPECULATIVE_TOKENS
from kvwire_serving.server import GrpcServer, build_channel
from kvwire_serving.telemetry import setup_tracing, start_metrics_server
from kvwire.files import LoadError
from kvwire.model import gguf
from kvwire.model.draft_head import is_draft_head, load_for_target, shipped_head
from kvwire.model.source import eos_token_ids, load_config
from kvwire.engine.async_engine import AsyncEngine
from kvwire.engine.core import EngineCore
from kvwire.engine.kv_source import KVSourcePolicy, KVSources, LocalPrefill
from decode_svc.remote_prefill import DEFAULT_TRANSFER_TIMEOUT_S, RemotePrefill
from kvwire.engine.runner import ModelRunner
from kvwire.engine.scheduler import SchedulerConfig
from kvwire.engine.speculative import SpecConfig
from kvwire.sampling_params import SpeculativeMode
from decode_svc.readiness import PrefillWatch
from decode_svc.server import DecodeServicer
from protos.kvwire.v1 import kvwire_pb2_grpc

log = logging.getLogger("decode_svc")


async def serve(args: argparse.Namespace) -> None:
    telemetry = setup_tracing("kvwire-decode")
    start_metrics_server(telemetry, args.metrics_port, security.metrics_host(args))
    server = GrpcServer(security=security.server_security(args), reflection=not args.no_reflection)
    lazy = Lazy(DecodeServicer, "decode_svc")
    server.add_service(kvwire_pb2_grpc.add_DecodeServiceServicer_to_server, lazy, "kvwire.v1.DecodeService")
    port = await server.start(args.listen)
    engine_cfg = cli.engine_config(args)
    threads = cli.set_threads(args)
    log.info("loading %s (weights %s, KV %s, %d compute threads) ...", engine_cfg.model_dir,
             engine_cfg.weights.value, engine_cfg.kv_dtype.value, threads)
    compute, loop = compute_executor("engine"), asyncio.get_running_loop()  # every torch call on one thread
    engine = await loop.run_in_executor(compute, load_engine, engine_cfg)
    eos = eos_token_ids(engine_cfg.model_dir, engine.model_config)  # no tokenizer.json needed
    draft = await loop.run_in_executor(compute, load_draft, args, engine_cfg, engine)
    runner = ModelRunner(engine, engine_cfg.num_pages, draft, prefix_caching=args.prefix_caching)
    await loop.run_in_executor(compute, runner.warm_up)
    gguf.forget_readers()  # everything read from a GGUF model file is loaded by now
    spec_cfg = SpecConfig(mode=SpeculativeMode(args.speculative), num_tokens=args.num_speculative_tokens,
                          adaptive=args.adaptive_speculation, ngram_max=args.ngram_max, ngram_min=args.ngram_min,
                          auto_off=args.speculative_auto_off, greedy_max_batch=args.speculative_greedy_max_batch)
    core = EngineCore(runner, SchedulerConfig(total_pages=engine_cfg.num_pages, max_waiting=args.max_waiting,
                                              max_running=args.max_running), spec_cfg, eos)
    # Without --prefill-addr every prompt prefills here; with it, KVSources picks per request.
    channel = build_channel(args.prefill_addr, security=security.client_security(args, "prefill")) if args.prefill_addr else None
    remote = RemotePrefill(runner, kvwire_pb2_grpc.PrefillServiceStub(channel), channel,
                           transfer_timeout_s=args.kv_transfer_timeout_s) if channel else None
    watch = PrefillWatch(channel, remote, server if args.readiness_follows_prefill else None,
                         args.prefill_health_interval_s) if remote else None
    policy = KVSourcePolicy(local_when_idle=args.local_prefill_when_idle,
                            local_max_tokens=args.local_prefill_max_tokens,
                            local_max_decoding=args.local_prefill_max_decoding,
                            remote_max_inflight=args.remote_prefill_max_inflight)
    decode = AsyncEngine(core, KVSources(LocalPrefill(runner), remote, policy), cores=cli.core_share(args, "decode", threads),
                         executor=compute)
    decode.start()
    metrics.watch_pool(decode.stats)  # running/waiting requests, KV pool use
    lazy.set(DecodeServicer(decode))
    first = await watch.first_check() if watch else True  # before SERVING: remote on from the first request
    await server.set_serving()
    if watch:
        await watch.start(first)
    log.info("decode_svc SERVING on port %d (prefill at %s)", port, args.prefill_addr or "none: local only")
    try:
        await server.serve_until_signal(grace_s=args.grace_s, drain_delay_s=args.drain_delay_s)
    finally:
        if watch:
            await watch.close()
        await decode.close()
        if channel is not None:
            await channel.close()
        telemetry.shutdown()


def draft_path(args: argparse.Namespace) -> Path | None:
    """The draft asked for: --draft-model-dir when given ('' = none); with --speculative draft and no
    --draft-model-dir, the ``<model-dir>-draft`` directory beside the model (the embedded pair)."""
    if args.draft_model_dir is not None:
        return Path(args.draft_model_dir) if args.draft_model_dir else None
    if args.speculative != "draft":
        return None
    sibling = Path(args.model_dir).parent / f"{Path(args.model_dir).name}-draft"
    if not sibling.is_dir() and shipped_head(args.model_dir) is not None:
        return shipped_head(args.model_dir)  # a registered model's draft head, from models/
    if not sibling.is_dir():
        raise LoadError(f"--speculative draft needs a draft model: pass --draft-model-dir (there is no "
                        f"{sibling} beside {args.model_dir})")
    return sibling


def load_draft(args: argparse.Namespace, target_cfg, target):
    """The draft model (or draft head) when one is asked for, else None (speculative=draft requests
    are then refused). A draft that does not share the target's vocabulary, or a head distilled
    from other weights, is a LoadError naming both."""
    path = draft_path(args)
    if path is None:
        log.info("no draft model: speculative=draft requests will be refused")
        return None
    if is_draft_head(path):
        weights = QuantMode(args.draft_weights or args.weights)
        head = load_for_target(path, target, weights)
        log.info("draft head %s loaded (weights %s; %d-token head vocabulary)", path, weights.value,
                 head.cfg.head_vocab)
        return head
    draft_config = load_config(path)
    if draft_config.vocab_size != target.model_config.vocab_size:
        raise LoadError(f"draft model {path} has vocab size {draft_config.vocab_size}, the target "
                        f"{target_cfg.model_dir} has {target.model_config.vocab_size}: a draft must share "
                        "the target's tokenizer")
    cfg = dataclasses.replace(target_cfg, model_dir=path, weights=QuantMode(args.draft_weights or args.weights),
                              kv_dtype=KVDtype(args.draft_kv_dtype))
    draft = load_engine(cfg)
    if draft.fingerprint.tokenizer_sha256 != target.fingerprint.tokenizer_sha256:
        raise LoadError(f"draft model {path} does not share the tokenizer of the target {target_cfg.model_dir} "
                        f"(tokenizer sha256 {draft.fingerprint.tokenizer_sha256[:12] or 'none'} vs "
                        f"{target.fingerprint.tokenizer_sha256[:12] or 'none'})")
    log.info("draft model %s loaded (weights %s, KV %s)", path, cfg.weights.value, cfg.kv_dtype.value)
    return draft


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m decode_svc", description=__doc__)
    cli.add_engine_args(ap, default_pages=2048)
    cli.add_server_args(ap, default_listen="127.0.0.1:50052")
    security.add_serving_args(ap, peers=("prefill",))
    ap.add_argument("--prefill-addr", default="127.0.0.1:50053",
                    help="prefill_svc address: host:port, or dns:///name:port for several replicas; '' = none "
                         "(every prompt prefills in this process)")
    ap.add_argument("--local-prefill-max-tokens", type=int, default=256,
                    help="prompts of at most this many tokens prefill here instead of on prefill_svc (unless "
                         "the request sets kv_source), while fewer than --local-prefill-max-decoding requests "
                         "decode here; longer ones go remote while prefill_svc is reachable. 0 = all go remote")
    ap.add_argument("--local-prefill-when-idle", action=argparse.BooleanOptionalAction, default=True,
                    help="a prompt of any length prefills here while nothing else runs here (no request "
                         "decoding, no prefill of this service's in flight): no steps to hold up, no pages to "
                         "ship. Turn off when prefill_svc runs on much faster hardware than decode")
    ap.add_argument("--local-prefill-max-decoding", type=int, default=8,
                    help="short prompts go to prefill_svc too once this many requests are decoding here "
                         "(a local prefill holds up their steps)")
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                    help="keep full prompt pages and reuse them for prompts with the same prefix; only the "
                         "pages decode lacks are computed locally or asked from prefill_svc")
    ap.add_argument("--remote-prefill-max-inflight", type=int, default=8,
                    help="with this many remote prefills running, further prompts prefill here (overload)")
    ap.add_argument("--kv-transfer-timeout-s", type=float, default=DEFAULT_TRANSFER_TIMEOUT_S,
                    help="longest a KV pull from prefill_svc may take (capped further by the caller's deadline); "
                         "a stalled prefill ends the request DEADLINE_EXCEEDED and frees its pages")
    ap.add_argument("--prefill-health-interval-s", type=float, default=5.0,
                    help="how often prefill_svc's health is checked; while it is not SERVING, AUTO requests "
                         "prefill here")
    ap.add_argument("--readiness-follows-prefill", action=argparse.BooleanOptionalAction, default=False,
                    help="opt-in: report kvwire.v1.DecodeService NOT_SERVING while prefill_svc is unreachable. "
                         "Off by default: decode serves through its local prefill meanwhile, and a prefill "
                         "outage must not take every decode pod out of service (the overall health, for "
                         "liveness, never follows prefill)")
    ap.add_argument("--max-running", type=int, default=16, help="requests decoded together at most")
    ap.add_argument("--max-waiting", type=int, default=64, help="queued requests before RESOURCE_EXHAUSTED")
    sp = ap.add_argument_group("speculative decoding")
    sp.add_argument("--speculative", choices=["none", "draft", "ngram"], default="none",
                    help="default mode for requests that do not set sampling.speculative")
    sp.add_argument("--num-speculative-tokens", type=int, default=4, metavar=f"1..{MAX_SPECULATIVE_TOKENS}",
                    help="default tokens proposed per step (k)")
    sp.add_argument("--adaptive-speculation", action=argparse.BooleanOptionalAction, default=True,
                    help="adapt k per request to its acceptance (+2 when all accepted, -1 otherwise, "
                         "between 1 and the request's k)")
    sp.add_argument("--speculative-auto-off", action=argparse.BooleanOptionalAction, default=True,
                    help="a request stops speculating while its acceptance is below break-even (and n-gram "
                         "requests start again when their lookups would have paid)")
    sp.add_argument("--speculative-greedy-max-batch", type=int, default=SpecConfig.greedy_max_batch, metavar="N",
                    help="greedy and unseeded sampled requests do not speculate in decode steps of more than N "
                         "requests (0: no limit); seeded sampled ones keep a batch-independent policy")
    sp.add_argument("--draft-model-dir", default=None,
                    help="draft model (same tokenizer as --model-dir) or draft head (a directory with "
                         "draft_head.json, distilled from --model-dir); loaded only when given, or with "
                         "--speculative draft from <model-dir>-draft beside the model; '' = none")
    sp.add_argument("--draft-weights", choices=[m.value for m in QuantMode], default=None,
                    help="draft (or draft head) weight mode (default: the target's --weights)")
    sp.add_argument("--draft-kv-dtype", choices=[d.value for d in KVDtype], default=KVDtype.BF16.value,
                    help="draft KV page dtype (bf16: the draft's writes skip fp8 scale upkeep; its pool has "
                         "--num-pages pages)")
    sp.add_argument("--ngram-max", type=int, default=SpecConfig.ngram_max, help="n-gram lookup: longest suffix tried")
    sp.add_argument("--ngram-min", type=int, default=1, help="n-gram lookup: shortest suffix tried")
    args = ap.parse_args()
    if not 1 <= args.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        ap.error(f"--num-speculative-tokens must be in [1, {MAX_SPECULATIVE_TOKENS}]")
    if args.kv_transfer_timeout_s <= 0 or args.prefill_health_interval_s <= 0:
        ap.error("--kv-transfer-timeout-s and --prefill-health-interval-s must be positive")
    if not 1 <= args.ngram_min <= args.ngram_max:
        ap.error("--ngram-min and --ngram-max need 1 <= min <= max")
    cli.setup_logging(args.log_level)
    cli.run_service("decode_svc", serve(args))


if __name__ == "__main__":
    main()
