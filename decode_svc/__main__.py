"""``python -m decode_svc``: serve DecodeService (admission, KV pull, continuous batching).

Flags: docs/configuration.md (declared in kvwire/args/sections.py); the assembly: decode_svc/app.py.
"""
from __future__ import annotations

from decode_svc.app import serve
from kvwire.args import parse_args
from kvwire_serving import cli


def main(argv: list[str] | None = None) -> None:
    args = parse_args("decode_svc", argv, description=__doc__.split("\n\n")[0])
    cli.setup_logging(args.serving.log_level)
    cli.run_service("decode_svc", serve(args))


if __name__ == "__main__":
    main()
