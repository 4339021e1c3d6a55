"""What every service's ``__main__`` does with its parsed ``EngineArgs`` (kvwire.args declares the flags):
compute threads, core sharing, logging, and running the main coroutine."""
from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Coroutine
from typing import Any

from kvwire import envs
from kvwire.files import LoadError
from kvwire.threads import usable_cpus
from kvwire_serving.cores import CoreShare


def set_threads(args: Any) -> int:
    """Apply ``--threads`` (``args.threads``: an ``EngineArgs.compute`` section or a namespace) to torch,
    which the CPU kernels follow; returns the count."""
    import torch

    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"--threads must be at least 1, got {args.threads}")
    n = args.threads or (None if envs.raw("OMP_NUM_THREADS") else usable_cpus())
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def core_share(args: Any, role: str, own: int):
    """The ``--share-cores`` lending for ``role`` ("prefill" or "decode") whose own share is
    ``own`` threads (what ``set_threads`` returned), or None without the flag."""
    if args.share_cores is None:
        return None
    share = CoreShare(args.share_cores, role, own=own, total=max(own, usable_cpus()))
    logging.getLogger("kvwire_serving.cores").info("sharing cores through %s: %d compute threads while the other role "
                                           "is idle, %d while both compute", share.path, share.total, share.own)
    return share


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
