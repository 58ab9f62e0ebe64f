"""Where the corpus walk's mask time goes: bench_grammar.py's radixlm run with the mask path's steps timed.

    python benchmarks/profile_masks.py --suite /tmp/js/jsonschema-*/json/tests/draft2020-12 [--limit N]

Prints the run's mask summary, then seconds and calls per step (nested: `walk` includes `classify` and
`exit_pairs` (token classes of terminal states new to the process) and `exits_taken` (the exit suffixes
taken from where a continuation resumes, a counted string's bytes after its quote too); `row` counts only
whole rows built,
wherever: masks or advancing, which mostly steps single bytes).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import bench_grammar  # noqa: E402

from radixlm.core.runtime.constrained import pda  # noqa: E402
from radixlm.core.runtime.constrained.tokens import terminal_tokens  # noqa: E402

seconds: dict[str, float] = collections.defaultdict(float)
calls: collections.Counter = collections.Counter()


def _timed(owner, name: str, tag: str, skip=None) -> None:
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        if skip is not None and skip(*args):
            return inner(*args, **kwargs)
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[tag] += time.perf_counter() - start
            calls[tag] += 1

    setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", required=True)
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    index = pda.GrammarIndex
    _timed(index, "_allowed_bits", "mask computed")
    _timed(index, "_walk", "walk")
    _timed(terminal_tokens, "_classify", "classify")
    _timed(terminal_tokens, "_exit_pairs", "exit_pairs")
    _timed(index, "_exits_taken", "exits_taken")
    _timed(index, "_row", "row", skip=lambda self, c: self._rows[c] is not None)
    _timed(index, "_moves_of", "moves_of")
    _timed(index, "_close", "close")
    _timed(index, "_intern", "intern")
    result = bench_grammar.run("radixlm", args.suite, args.limit, False, "qwen2", 0)
    print("compiled", result["compiled"], "mask µs", result["mask_us"])
    for tag in sorted(seconds, key=seconds.get, reverse=True):
        print(f"{tag:14s} {seconds[tag]:8.3f} s {calls[tag]:8d} calls")


if __name__ == "__main__":
    main()
