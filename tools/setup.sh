#!/usr/bin/env bash
# Set up (idempotently) the project's virtual environment in .venv and generate the gRPC stubs.
# Usage: source tools/setup.sh   (or bash tools/setup.sh)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# The CPU build of torch first: the project's range then installs nothing bigger.
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,bench,codegen]"
if [ -f protos/generate.py ]; then .venv/bin/python -m protos.generate; fi
# Compile the CPU decode kernels for this machine now (seconds), not in the first process that needs them.
.venv/bin/python -m kvwire_kernels.cpu
