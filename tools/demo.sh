#!/usr/bin/env bash
# Set up, start the three services on localhost with the embedded model, stream one completion.
# Extra arguments go to tools/run_local.py (e.g. --prompt "..." --max-tokens 120 --keep-running).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/setup.sh
exec .venv/bin/python -m tools.run_local "$@"
