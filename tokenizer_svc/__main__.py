"""``python -m tokenizer_svc --model-dir models/kvwire-tiny --listen 127.0.0.1:50051
--decode-addr 127.0.0.1:50052``

Flags: docs/configuration.md (declared in kvwire/args/sections.py); the assembly: tokenizer_svc/app.py.
"""
from __future__ import annotations

import logging

from kvwire.args import parse_args
from kvwire_serving.cli import run_service
from kvwire_serving.telemetry import setup_tracing
from tokenizer_svc.app import serve, service_config

DESCRIPTION = "Tracing is configured by the standard OTEL_* variables (see kvwire_serving.telemetry)."


def main(argv: list[str] | None = None) -> None:
    args = parse_args("tokenizer_svc", argv, description=DESCRIPTION)
    logging.basicConfig(level=args.serving.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = service_config(args)
    telemetry = setup_tracing("kvwire-tokenizer")
    try:
        run_service("tokenizer_svc", serve(cfg, telemetry))  # a bad model path: one line, exit 1
    finally:
        telemetry.shutdown()


if __name__ == "__main__":
    main()
