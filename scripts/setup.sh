#!/usr/bin/env bash
# Creates .venv with the CPU build of torch (the wheel on disk; never a CUDA download) and radixlm.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
. .venv/bin/activate
pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
pip install -q -e ".[$1]"
