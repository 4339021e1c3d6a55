"""``python -m decode_svc``: serve DecodeService (admission, KV pull, continuous batching)."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from pathlib import Path

from kvwire import cli
from kvwire.config import KVDtype, QuantMode
from kvwire.lazy import Lazy
from kvwire.runtime import load_engine
from kvwire.sampling import MAX_SPECULATIVE_TOKENS
from kvwire.serving import GrpcServer, build_channel
from kvwire.telemetry import setup_tracing, start_metrics_server
from kvwire.tokenizer import ModelTokenizer
from decode_svc.engine import DecodeEngine
from decode_svc.runner import DecodeRunner
from decode_svc.scheduler import Scheduler, SchedulerConfig
from decode_svc.server import DecodeServicer
from decode_svc.speculative import SpecConfig
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
    draft = await asyncio.to_thread(load_draft, args, engine_cfg, engine)
    runner = DecodeRunner(engine, engine_cfg.num_pages, draft)
    await asyncio.to_thread(runner.warm_up)
    scheduler = Scheduler(SchedulerConfig(total_pages=engine_cfg.num_pages, block_size=engine_cfg.block_size,
                                          max_waiting=args.max_waiting, max_running=args.max_running,
                                          sliding_window=engine.model_config.sliding_window))
    channel = build_channel(args.prefill_addr)
    spec_cfg = SpecConfig(mode=args.speculative, num_tokens=args.num_speculative_tokens,
                          adaptive=args.adaptive_speculation, ngram_max=args.ngram_max, ngram_min=args.ngram_min)
    decode = DecodeEngine(runner, scheduler, kvwire_pb2_grpc.PrefillServiceStub(channel), eos, spec_cfg)
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


def load_draft(args: argparse.Namespace, target_cfg, target):
    """The draft model for speculative=draft, or None when none is configured or found."""
    path = args.draft_model_dir
    if path is None or not str(path) or not (Path(path) / "config.json").is_file():
        if args.speculative == "draft":
            raise SystemExit(f"--speculative draft needs a draft model, but {path} has no config.json "
                             "(train it with tools/train_embedded.py or pass --draft-model-dir)")
        log.info("no draft model at %s: speculative=draft requests will be refused", path)
        return None
    cfg = dataclasses.replace(target_cfg, model_dir=Path(path), weights=QuantMode(args.draft_weights),
                              kv_dtype=KVDtype(args.draft_kv_dtype))
    draft = load_engine(cfg)
    if draft.model_config.vocab_size != target.model_config.vocab_size or \
            draft.fingerprint.tokenizer_sha256 != target.fingerprint.tokenizer_sha256:
        raise SystemExit(f"draft model {path} does not share the target's tokenizer (vocab "
                         f"{draft.model_config.vocab_size} vs {target.model_config.vocab_size}, tokenizer sha256 "
                         f"{draft.fingerprint.tokenizer_sha256[:12]} vs {target.fingerprint.tokenizer_sha256[:12]})")
    log.info("draft model %s loaded (weights %s, KV %s)", path, cfg.weights.value, cfg.kv_dtype.value)
    return draft


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m decode_svc", description=__doc__)
    cli.add_engine_args(ap, default_pages=2048)
    cli.add_server_args(ap, default_listen="127.0.0.1:50052")
    ap.add_argument("--prefill-addr", default="127.0.0.1:50053",
                    help="prefill_svc address: host:port, or dns:///name:port for several replicas")
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
    sp.add_argument("--draft-model-dir", type=Path, default=cli.DEFAULT_MODEL_DIR.parent / "kvwire-tiny-draft",
                    help="draft model (same tokenizer as --model-dir), loaded when the directory exists; "
                         "'' = none")
    sp.add_argument("--draft-weights", choices=[m.value for m in QuantMode], default=QuantMode.NONE.value,
                    help="draft weight mode")
    sp.add_argument("--draft-kv-dtype", choices=[d.value for d in KVDtype], default=KVDtype.BF16.value,
                    help="draft KV page dtype (bf16: the draft's writes skip fp8 scale upkeep; its pool has "
                         "--num-pages pages)")
    sp.add_argument("--ngram-max", type=int, default=3, help="n-gram lookup: longest suffix tried")
    sp.add_argument("--ngram-min", type=int, default=1, help="n-gram lookup: shortest suffix tried")
    args = ap.parse_args()
    if not 1 <= args.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        ap.error(f"--num-speculative-tokens must be in [1, {MAX_SPECULATIVE_TOKENS}]")
    if not 1 <= args.ngram_min <= args.ngram_max:
        ap.error("--ngram-min and --ngram-max need 1 <= min <= max")
    cli.setup_logging(args.log_level)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
