#!/usr/bin/env bash
# Sets up a virtual environment (CPU torch from the local wheel cache) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q -e '.[dev,server,openai,langchain,dspy]'
TRITON_INTERPRET=1 python -m pytest tests "$@"
