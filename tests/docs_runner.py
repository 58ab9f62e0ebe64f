"""Runs the documents' python blocks for test_docs_snippets.py, in this one process (so torch and the
model load once, not once per document): `python docs_runner.py BLOCKS.json RESULTS.json`.

Each block runs in a fresh namespace (a `# docs-test: continues` block: in the names the earlier blocks
of its document left), under a time limit. `radixlm.Engine(...)` is shared between blocks with the same
arguments (a block's `with` or shutdown() leaves it to the next); the engines are shut down at the end.
Results are written after every block, keyed `doc#index`, so a crash still reports the blocks before.
"""

from __future__ import annotations

import json
import signal
import sys
import traceback
from typing import Any

import radixlm
from radixlm.core.runtime.engine import Engine


class BlockTimeout(Exception):
    pass


def _shared_engines() -> dict[str, Engine]:
    engines: dict[str, Engine] = {}

    def shared(model_path: str | None = None, **options: Any) -> Engine:
        key = json.dumps([model_path, options], sort_keys=True, default=repr)
        if key not in engines:
            engine = Engine(model_path, **options)
            engine.shutdown = lambda: None  # `with` and shutdown() in a block leave it to the next block
            engines[key] = engine
        return engines[key]

    radixlm.Engine = shared  # an attribute wins over the package's lazy __getattr__
    return engines


def main(blocks_path: str, results_path: str) -> None:
    blocks = json.load(open(blocks_path))
    engines = _shared_engines()
    names: dict[str, Any] = {}
    results: dict[str, str | None] = {}

    def on_alarm(signum: int, frame: Any) -> None:
        raise BlockTimeout("the block ran past its time limit")

    signal.signal(signal.SIGALRM, on_alarm)
    doc = None
    for block in blocks:
        if block["doc"] != doc:
            doc, names = block["doc"], {}
        scope = dict(names) if block["continues"] else {"__name__": "__main__"}
        signal.alarm(block["timeout"])
        try:
            exec(compile(block["code"], f"<{block['doc']} block {block['index']}>", "exec"), scope)
            results[f"{doc}#{block['index']}"] = None
        except BaseException:  # noqa: BLE001  (reported, then the next block runs)
            results[f"{doc}#{block['index']}"] = traceback.format_exc()[-3000:]
        finally:
            signal.alarm(0)
        names.update(scope)
        with open(results_path, "w") as f:  # written after each block: a crash still reports the others
            json.dump(results, f)
    for engine in engines.values():
        Engine.shutdown(engine)


if __name__ == "__main__":
    main(*sys.argv[1:3])
