#!/usr/bin/env bash
# Refreshes constraints.txt, the dependency set scripts/setup.sh installs by default: pip's resolver picks
# the newest releases pyproject.toml's bounds allow for every extra, in a fresh venv beside the CPU
# torch on disk, and the result is frozen. Run the test suite on it (bash scripts/test.sh) before
# committing the new file.
#
#   bash scripts/lock.sh
set -euo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --upgrade pip
"$work/venv/bin/pip" install -q torch==2.13.0
"$work/venv/bin/pip" install -q ".[dev,server,openai,langchain,dspy,vision,llguidance]"
{
    echo "# Made by scripts/lock.sh on $(date -u +%Y-%m-%d) (pip's resolver, Python $("$work/venv/bin/python" -c 'import platform; print(platform.python_version())')): the set"
    echo "# bash scripts/test.sh passes with. scripts/setup.sh installs it by default; pip install radixlm does not."
    # The local label of the CPU build (2.13.0+cpu) is dropped: ==2.13.0 admits it and the same release's
    # other builds, so a venv whose torch came from elsewhere is not asked to swap it.
    "$work/venv/bin/pip" freeze --exclude radixlm | sed -E 's/^(torch==[^+]+)\+.*/\1/'
} > constraints.txt
echo "constraints.txt: $(grep -vc '^#' constraints.txt) packages"
