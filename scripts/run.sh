#!/usr/bin/env bash
# Sets up, then runs a shared-prefix program on the embedded default model (or MODEL_PATH if set).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh server
. .venv/bin/activate
python examples/quickstart.py ${MODEL_PATH:+--model-path "$MODEL_PATH"}
