#!/usr/bin/env bash
# Sets up, then runs the whole test suite (Triton kernels run in the interpreter on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,server,openai,langchain,dspy
. .venv/bin/activate
TRITON_INTERPRET=1 python -m pytest tests "$@"
