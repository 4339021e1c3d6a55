"""Command-line flags shared by the services, turned into frozen configs (once, in ``__main__``)."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from kvwire.config import KVDtype, QuantMode
from kvwire.runtime import EngineConfig

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "kvwire-tiny"


def add_engine_args(ap: argparse.ArgumentParser, default_pages: int) -> None:
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                    help="local HF model directory (config.json, safetensors, tokenizer.json)")
    ap.add_argument("--weights", choices=[m.value for m in QuantMode], default=QuantMode.NONE.value,
                    help="weight mode: none (checkpoint as fp32), bf16, int8 (weight-only), fp8 (W8A8)")
    ap.add_argument("--kv-dtype", choices=[d.value for d in KVDtype], default=KVDtype.FP8_E4M3.value,
                    help="KV page dtype, in memory and on the wire")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--num-pages", type=int, default=default_pages, help="KV pages in this service's pool")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model_dir=args.model_dir, weights=QuantMode(args.weights), kv_dtype=KVDtype(args.kv_dtype),
                        block_size=args.block_size, num_pages=args.num_pages)


def add_server_args(ap: argparse.ArgumentParser, default_listen: str) -> None:
    ap.add_argument("--listen", default=default_listen, help="host:port to serve on (port 0: any free port)")
    ap.add_argument("--grace-s", type=float, default=20.0, help="seconds in-flight calls get at SIGTERM")
    ap.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    ap.add_argument("--log-level", default="INFO")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
