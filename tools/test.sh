#!/usr/bin/env bash
# Set up the environment and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/setup.sh
exec .venv/bin/python -m pytest -q "$@"
