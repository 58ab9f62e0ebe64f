"""Every ```python block of README.md and docs/*.md runs on the embedded default model.

The blocks of one document run in one subprocess (tests/docs_runner.py), each in a fresh namespace
with a time limit, sharing the engines they create with the same arguments, so a document loads its
model once. Blocks that talk to a server at 127.0.0.1:30000 get one shared `radixlm serve` (on a free
port, substituted into the block). A block says in its first lines when it cannot run here:
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

from server_harness import ServerProcess

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
def doc_results(tmp_path_factory):
    """doc -> {block index: traceback or None}, running each document once, when first asked."""
    results: dict[str, dict[str, str | None]] = {}
    server: list[ServerProcess] = []

    def run(doc: str) -> dict[str, str | None]:
        if doc not in results:
            blocks = [b for b in BLOCKS if b["doc"] == doc and not b["skip"]]
            if any(SERVER in b["code"] for b in blocks) and not server:
                server.append(ServerProcess())
            if server:
                address = server[0].url.removeprefix("http://")
                blocks = [{**b, "code": b["code"].replace(SERVER, address)} for b in blocks]
            folder = tmp_path_factory.mktemp("docs")
            (folder / "blocks.json").write_text(json.dumps(blocks))
            proc = subprocess.run([sys.executable, str(ROOT / "tests" / "docs_runner.py"), "blocks.json",
                                   "results.json"], cwd=folder, capture_output=True, text=True,
                                  timeout=BLOCK_TIMEOUT_S * max(len(blocks), 1) + 60,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1"))
            found = json.loads((folder / "results.json").read_text()) if (folder / "results.json").exists() else {}
            results[doc] = {str(b["index"]): found.get(str(b["index"]), f"no result (runner exit {proc.returncode}):"
                                                                         f"\n{proc.stderr[-3000:]}") for b in blocks}
        return results[doc]

    yield run
    for s in server:
        s.kill()


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b['doc']}#{b['index']}" for b in BLOCKS])
def test_docs_block_runs(block, doc_results):
    if block["skip"]:
        pytest.skip(f"marked {block['skip']}")
    error = doc_results(block["doc"])[str(block["index"])]
    assert error is None, f"{block['doc']} block {block['index']} failed:\n{block['code']}\n{error}"
