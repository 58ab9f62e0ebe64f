#!/usr/bin/env bash
# CI's second leg: a fresh venv on the newest releases pyproject.toml's bounds allow (constraints.txt not
# applied; torch held to the CPU build on disk), then the checks a dependency's next release breaks first:
# no shadowing and the server started from the repository root, the transformers oracle, the engine, the
# real default model answering, the server's endpoints. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
VENV="$work/venv" RADIXLM_NEWEST=1 bash scripts/setup.sh dev,server,openai,langchain,dspy
. "$work/venv/bin/activate"
TRITON_INTERPRET=1 python -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile tests/test_fresh_machine.py \
    tests/test_tiny_checkpoint.py tests/test_engine_hf.py tests/test_engine_runtime.py tests/test_real_model.py \
    tests/test_server_openai.py "$@"
