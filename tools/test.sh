#!/usr/bin/env bash
# Set up the environment and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/setup.sh
# The real model's tests (marked real_model) run when it is cached; fetching takes seconds. A failed
# fetch is not a failed run: those tests then skip and say why.
.venv/bin/python -m tools.fetch_model smollm2-135m-instruct >/dev/null \
  || echo "test.sh: smollm2-135m-instruct not fetched; the real_model tests will skip" >&2
exec .venv/bin/python -m pytest -q "$@"
