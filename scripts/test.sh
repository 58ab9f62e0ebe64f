#!/usr/bin/env bash
# Sets up, then runs the whole test suite (Triton kernels run in the interpreter on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,server,openai,langchain,dspy
. .venv/bin/activate
# Two workers (CI's two cores), each test file on one worker so that its module fixtures (engines,
# servers) are built once; TEST_WORKERS=0 runs in this process.
TRITON_INTERPRET=1 python -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile tests "$@"
