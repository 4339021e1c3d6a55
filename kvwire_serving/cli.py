"""Command-line flags shared by the services, turned into frozen configs (once, in ``__main__``)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING

from kvwire import envs
from kvwire.config import DEFAULT_MODEL_DIR, KVDtype, QuantMode
from kvwire.threads import usable_cpus
from kvwire.files import LoadError
from kvwire_serving.cores import CoreShare

if TYPE_CHECKING:  # kvwire.runtime imports torch; the tokenizer service imports this module without it
    from kvwire.runtime import EngineConfig



def add_engine_args(ap: argparse.ArgumentParser, default_pages: int) -> None:
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                    help="local HF model directory (config.json + safetensors), a .gguf file or a directory "
                         "holding one, or a fetched model's name (python -m tools.fetch_model --list)")
    ap.add_argument("--weights", choices=[m.value for m in QuantMode], default=QuantMode.INT8.value,
                    help="weight mode: int8 (default: weight-only, the fastest within the accuracy budget), "
                         "bf16, fp8 (weight-only e4m3), none (the checkpoint as fp32)")
    ap.add_argument("--kv-dtype", choices=[d.value for d in KVDtype], default=KVDtype.FP8_E4M3.value,
                    help="KV page dtype, in memory and on the wire")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--num-pages", type=int, default=default_pages, help="KV pages in this service's pool")
    ap.add_argument("--device", default="cpu",
                    help="torch device for weights and KV pages: cpu (default) or cuda[:N] (Triton kernels)")
    ap.add_argument("--threads", type=int, default=None,
                    help="compute threads (torch and the CPU kernels). Default: OMP_NUM_THREADS if set, else "
                         "the CPUs this process may use (its CPU affinity, capped by a cgroup CPU limit such "
                         "as a Kubernetes pod's). Services sharing a host should split its cores between "
                         "them: OpenMP threads that outnumber the cores stall each other at every barrier")
    ap.add_argument("--share-cores", type=Path, default=None, metavar="FILE",
                    help="prefill_svc and decode_svc on one host, given the same FILE (created if missing): "
                         "each computes on all usable CPUs while the other is idle and on its --threads "
                         "share while both compute (tools/stack.py passes one when it splits the cores)")




def set_threads(args: argparse.Namespace) -> int:
    """Apply ``--threads`` (see its help) to torch, which the CPU kernels follow; returns the count."""
    import torch

    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"--threads must be at least 1, got {args.threads}")
    n = args.threads or (None if envs.raw("OMP_NUM_THREADS") else usable_cpus())
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def core_share(args: argparse.Namespace, role: str, own: int):
    """The ``--share-cores`` lending for ``role`` ("prefill" or "decode") whose own share is
    ``own`` threads (what ``set_threads`` returned), or None without the flag."""
    if args.share_cores is None:
        return None
    share = CoreShare(args.share_cores, role, own=own, total=max(own, usable_cpus()))
    logging.getLogger("kvwire_serving.cores").info("sharing cores through %s: %d compute threads while the other role "
                                           "is idle, %d while both compute", share.path, share.total, share.own)
    return share


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from kvwire.runtime import EngineConfig

    return EngineConfig(model_dir=args.model_dir, weights=QuantMode(args.weights), kv_dtype=KVDtype(args.kv_dtype),
                        block_size=args.block_size, num_pages=args.num_pages,
                        device=args.device)


def add_server_args(ap: argparse.ArgumentParser, default_listen: str) -> None:
    ap.add_argument("--listen", default=default_listen, help="host:port to serve on (port 0: any free port)")
    ap.add_argument("--grace-s", type=float, default=20.0, help="seconds in-flight calls get at SIGTERM")
    ap.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    ap.add_argument("--log-level", default="INFO")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")


def run_service(name: str, main: Coroutine) -> None:
    """Run a service's main coroutine; a model that cannot be loaded (missing or bad config.json,
    weights, GGUF, draft) ends the process with one line naming the file and exit code 1."""
    try:
        asyncio.run(main)
    except LoadError as e:
        logging.shutdown()
        print(f"{name}: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Not sys.exit: the gRPC server already listening would print a traceback from its
        # destructor once the event loop is gone. Nothing is in flight yet, so exit at once.
        os._exit(1)
