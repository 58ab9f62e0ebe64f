"""The corpus walk's mask tail: bench_grammar.py's radixlm run with each computed mask's thread CPU time kept.

    python benchmarks/mask_tail.py --suite /tmp/js/jsonschema-*/json/tests/draft2020-12 [--maskbench DIR] [--limit N] [--parts]
        [--wide-at-compile]

Prints the run's mask summary, the computed masks' 30th/45th/59th/80th/120th largest times, how many
exceed 100 µs, 300 µs and 1 ms (and their sum over 100 µs), and the garbage collections that ran inside
masks. Only GrammarIndex._allowed_bits is wrapped: a timer around a step called thousands of times a run
(profile_masks.py's) adds its own cost to that step, enough to make a change that calls it less look
faster when it is not (benchmarks/results/2026-12-02-grammar-masks.md). `--parts` also times, per computed
mask, its token classes (first visits to terminal states: trie walks), exit walks (per continuation) and
bits set from ids, a few calls a mask (their timers add a few µs to each), and prints them per band of mask
time; and, at each full collection, the tracked objects it walks, and after the run the tracked objects left
by type. `--wide-at-compile` builds every wide terminal state's token classes with each compile and prints
what that adds to the compile.
"""

from __future__ import annotations

import argparse
import array
import collections
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import bench_grammar  # noqa: E402

import numpy as np  # noqa: E402

from radixlm.core.runtime.constrained import pda  # noqa: E402
from radixlm.core.runtime.constrained.tokens.counted_string import CountedStringDFA  # noqa: E402
from radixlm.core.runtime.constrained.tokens.narrow_walk import NARROW_NODES, state_row  # noqa: E402
from radixlm.core.runtime.constrained.tokens.terminal_tokens import state_tokens  # noqa: E402

RANKS = (30, 45, 59, 80, 120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--maskbench", metavar="DIR", help="as bench_grammar.py's: MaskBench's schemas too")
    parser.add_argument("--no-freeze", action="store_true", help="as bench_grammar.py's: the heap left unfrozen")
    parser.add_argument("--parts", action="store_true", help="time each computed mask's parts (see above)")
    parser.add_argument("--wide-at-compile", action="store_true",
                        help="build every wide terminal state's token classes with each compile (timed in it)")
    args = parser.parse_args()
    bench_grammar.MASK_CLOCK = time.thread_time
    computed = array.array("d")  # as bench_grammar.py's mask times: not walked by the collector
    collections: dict[int, list[float]] = {}  # per generation: µs of each collection inside a mask
    inside, started = [False], [0.0]
    parts: list[dict[str, float]] = []  # per computed mask (--parts): µs per part
    full_objects: list[int] = []  # tracked objects walked by each full collection (--parts)

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            if args.parts and info["generation"] == 2:
                full_objects.append(sum(len(gc.get_objects(g)) for g in range(3)))
            started[0] = time.thread_time()
        elif inside[0]:
            collections.setdefault(info["generation"], []).append((time.thread_time() - started[0]) * 1e6)

    allowed_bits = pda.GrammarIndex._allowed_bits

    def timed(self, state: int, vocab_size: int):
        inside[0] = True
        parts.append({})
        start = time.thread_time()
        try:
            return allowed_bits(self, state, vocab_size)
        finally:
            computed.append((time.thread_time() - start) * 1e6)
            inside[0] = False

    pda.GrammarIndex._allowed_bits = timed
    if args.parts:
        _time_parts(parts, inside)
    added = _wide_at_compile() if args.wide_at_compile else None
    gc.callbacks.append(on_gc)
    result = bench_grammar.run("radixlm", args.suite, args.limit, False, "qwen2", 0, not args.no_freeze, args.maskbench)
    gc.callbacks.remove(on_gc)
    masks = {k: round(v, 1) for k, v in result["mask_us"].items()}
    print("compiled", result["compiled"], "valid", result["valid"], "invalid accepted", result["invalid_accepted"])
    print("mask µs", masks)
    ranked = sorted(computed, reverse=True)
    print(f"computed {len(ranked)}; largest", " / ".join(f"{n}th {ranked[n - 1]:.0f}" for n in RANKS if n <= len(ranked)))
    over = {x: sum(t > x for t in ranked) for x in (100, 300, 1000)}
    print(f"> 100 / 300 / 1000 µs: {over[100]} / {over[300]} / {over[1000]};",
          f"their sum over 100 µs {sum(t - 100 for t in ranked if t > 100) / 1e3:.0f} ms")
    for generation, times in sorted(collections.items()):
        print(f"gc generation {generation} inside masks: {len(times)} collections, {sum(times) / 1e3:.1f} ms,"
              f" largest {max(times):.0f} µs")
    if args.parts:
        _print_parts(computed, parts, full_objects)
    if added is not None:
        print("compile ms", {k: round(v, 2) for k, v in result["compile_ms"].items()}, "of which wide states p50 / p90 / "
              "p99 / max", " / ".join(f"{x:.2f}" for x in np.percentile(added, [50, 90, 99, 100])))


def _wide_at_compile() -> list[float]:
    """Wraps the benchmark's compile so that it also builds the token classes of every state of every
    terminal (not counted, its table built) that reads over NARROW_NODES bytes, as a compile-time alternative to first
    visits (xgrammar's); returns the list the ms each compile added go to."""
    added: list[float] = []
    compile_ = bench_grammar.Engine.compile

    def compile_all(self, schema):
        constraint = compile_(self, schema)
        start = time.perf_counter()
        index = constraint.index
        for name, dfa in zip(index.grammar.terminal_names, index.grammar.terminals):
            if isinstance(dfa, CountedStringDFA) or not isinstance(dfa.transitions, np.ndarray):
                continue  # counted, or a table built as it is read
            for q in range(len(dfa.transitions)):
                if len(state_row(name, dfa, q)[1]) > NARROW_NODES:
                    state_tokens(name, dfa, q, index.vocab)
        added.append((time.perf_counter() - start) * 1e3)
        return constraint
    bench_grammar.Engine.compile = compile_all
    return added


PARTS = {"classes": (pda.GrammarIndex, "_classes"), "exit walks": (pda.GrammarIndex, "_exits_taken"),
         "bits set": (pda, "set_bits")}
BANDS = ((100, 300), (300, 2000), (2000, float("inf")))


def _time_parts(parts: list[dict[str, float]], inside: list[bool]) -> None:
    """Wraps PARTS with timers adding their thread CPU µs to the current computed mask's entry."""
    for name, (owner, attr) in PARTS.items():
        def timed(*a, _f=getattr(owner, attr), _name=name, **k):
            if not inside[0]:
                return _f(*a, **k)
            start = time.thread_time()
            try:
                return _f(*a, **k)
            finally:
                parts[-1][_name] = parts[-1].get(_name, 0.0) + (time.thread_time() - start) * 1e6
        setattr(owner, attr, timed)


def _print_parts(computed: list[float], parts: list[dict[str, float]], full_objects: list[int]) -> None:
    for lo, hi in BANDS:
        band = [(t, p) for t, p in zip(computed, parts) if lo < t <= hi]
        sums = {name: sum(p.get(name, 0.0) for _, p in band) / 1e3 for name in PARTS}
        total = sum(t for t, _ in band) / 1e3
        print(f"computed masks {lo}-{hi} µs: {len(band)}, {total:.0f} ms;",
              ", ".join(f"{name} {ms:.0f} ms" for name, ms in sums.items()), f"the rest {total - sum(sums.values()):.0f} ms")
    print("tracked objects at each full collection:", full_objects)
    gc.collect()
    left = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
    print("tracked objects left (not frozen):", sum(left.values()), dict(left.most_common(8)))


if __name__ == "__main__":
    main()
