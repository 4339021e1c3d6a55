#!/usr/bin/env bash
# Set up, fetch the real model (SmolLM2-135M-Instruct, GGUF), start the three services on localhost
# and stream a chat answer. If the model cannot be fetched, say why and use the embedded model instead
# (a raw completion). Extra arguments go to tools/run_local.py (e.g. --prompt "..." --max-tokens 120
# --keep-running; --prefill-replicas 2 --decode-replicas 2 [--decode-routing prefix] for several
# replicas of each on loopback); KVWIRE_DEMO_MODEL=embedded skips the fetch.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/setup.sh
MODEL=smollm2-135m-instruct
if [ "${KVWIRE_DEMO_MODEL:-$MODEL}" = "$MODEL" ] && .venv/bin/python -m tools.fetch_model "$MODEL" >/dev/null; then
  # int8 weights (the services' default): the fastest mode within the accuracy budget (README).
  exec .venv/bin/python -m tools.run_local --model-dir "$MODEL" --weights int8 --chat \
    --prompt "What is the capital of France?" --max-tokens 60 "$@"
fi
echo "demo: using the embedded model models/kvwire-tiny instead of $MODEL (raw completion, no chat)" >&2
exec .venv/bin/python -m tools.run_local "$@"
