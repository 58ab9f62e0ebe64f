"""Every ```python block of README.md and docs/*.md runs on the embedded default model.

The blocks run in one subprocess (tests/docs_runner.py), each in a fresh namespace with a time limit,
sharing the engines they create with the same arguments, so torch and the model load once (a process
per document cost about 10 s of CPU each, most of the test). Blocks that talk to a server at
127.0.0.1:30000 get one shared `radixlm serve` (on a free port, substituted into the block). A block says in its first lines when it cannot run here:
`# docs-test: needs-gpu`, `# docs-test: needs-network` (or a model this machine lacks), or
`# docs-test: outline` (a signature or shape listing, not a program); `# docs-test: continues` runs it
with the names the document's earlier blocks defined, as a reader would.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import pytest

from radixlm.testing.servers import ServerProcess

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKERS = ("needs-gpu", "needs-network", "outline", "continues")
SKIPPING = {"needs-gpu", "needs-network", "outline"}
SERVER = "127.0.0.1:30000"
BLOCK_TIMEOUT_S = 180


def _markers(code: str) -> set[str]:
    found = set(re.findall(r"# docs-test: ([a-z-]+)", code))
    assert found <= set(MARKERS), f"unknown docs-test markers {found - set(MARKERS)}; known: {MARKERS}"
    return found


def _blocks() -> list[dict[str, Any]]:
    out = []
    for path in DOCS:
        doc = path.relative_to(ROOT).as_posix()
        for i, m in enumerate(re.finditer(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)):
            markers = _markers(m.group(1))
            out.append({"doc": doc, "index": i, "code": m.group(1), "continues": "continues" in markers,
                        "skip": sorted(markers & SKIPPING), "timeout": BLOCK_TIMEOUT_S})
    return out


BLOCKS = _blocks()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, str | None]:
    """Maps "doc#index" to a traceback or None, for every block not marked to be skipped, from one run."""
    blocks = [b for b in BLOCKS if not b["skip"]]
    server = ServerProcess() if any(SERVER in b["code"] for b in blocks) else None
    try:
        if server is not None:
            address = server.url.removeprefix("http://")
            blocks = [{**b, "code": b["code"].replace(SERVER, address)} for b in blocks]
        folder = tmp_path_factory.mktemp("docs")
        (folder / "blocks.json").write_text(json.dumps(blocks))
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "docs_runner.py"), "blocks.json",
                               "results.json"], cwd=folder, capture_output=True, text=True,
                              timeout=BLOCK_TIMEOUT_S * len(blocks) + 60, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    finally:
        if server is not None:
            server.kill()
    found = json.loads((folder / "results.json").read_text()) if (folder / "results.json").exists() else {}
    missing = f"no result (runner exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return {f"{b['doc']}#{b['index']}": found.get(f"{b['doc']}#{b['index']}", missing) for b in blocks}


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b['doc']}#{b['index']}" for b in BLOCKS])
def test_docs_block_runs(block, results):
    if block["skip"]:
        pytest.skip(f"marked {block['skip']}")
    error = results[f"{block['doc']}#{block['index']}"]
    assert error is None, f"{block['doc']} block {block['index']} failed:\n{block['code']}\n{error}"
