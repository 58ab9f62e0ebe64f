"""Compile time alone, per schema, on bench_grammar.py's corpus: conversion (schema -> grammar), rule
compilation (grammar -> automata) and the index's start, in CPU seconds of this process (steadier than wall
time on a shared machine), slowest first. No masks, no walks: for profiling the compile tail.

What belongs to the tokenizer and not to a schema (its TokenVocab, byte trie, and the vocabulary read as
string content: grammar_index_cache.prepare_vocab) is built once before the first schema is timed, as an
engine does at start and as bench_grammar.py builds llguidance's tokenizer once; its cost is printed.

    python benchmarks/bench_compile.py --suite /tmp/js/jsonschema-*/json/tests/draft2020-12 [--maskbench DIR] [--only NAME] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_grammar  # noqa: E402


def main() -> None:
    from radixlm.core.runtime.constrained import grammar_index_cache
    from radixlm.testing.constrained import qwen2_tokenizer
    from radixlm.core.runtime.constrained.automata.grammar_compiler import Deadline, GrammarBudget, compile_grammar
    from radixlm.core.runtime.constrained.pda import GrammarIndex
    from radixlm.core.runtime.constrained.schema.schema_refs import register_documents

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", required=True, help="the JSON-Schema-Test-Suite's draft2020-12 folder")
    parser.add_argument("--maskbench", metavar="DIR", help="also bench_grammar.py's MaskBench sample (its data/ folder)")
    parser.add_argument("--only", help="schemas whose name contains this")
    parser.add_argument("--top", type=int, default=20, help="slowest schemas listed")
    parser.add_argument("--budget", type=float, default=2.0, help="max_compile_seconds")
    parser.add_argument("--profile", action="store_true", help="cProfile of the compiles, by cumulative and by own time")
    args = parser.parse_args()
    tokenizer = qwen2_tokenizer()
    start = time.process_time()
    vocab = grammar_index_cache.prepare_vocab(tokenizer)
    print(f"tokenizer prepared once (prepare_vocab): {time.process_time() - start:.2f} s CPU")
    register_documents(Path(args.suite).parent.parent / "remotes", bench_grammar.REMOTE)
    budget = GrammarBudget(max_compile_seconds=args.budget)
    profile = cProfile.Profile() if args.profile else None
    rows, refused = [], 0
    for case in bench_grammar.corpus(args.suite, args.maskbench):
        if args.only and args.only not in case["name"]:
            continue
        grammar_index_cache._cache.clear()  # a schema never seen
        try:
            if profile:
                profile.enable()
            with grammar_index_cache.gc_paused():  # as get_grammar_index compiles
                start = time.process_time()
                deadline = Deadline(budget)
                grammar = grammar_index_cache.grammar_of("json_schema", case["schema"], None, budget, deadline)
                converted = time.process_time()
                compiled = compile_grammar(grammar, budget, deadline)
                ruled = time.process_time()
                GrammarIndex(compiled, vocab)
                end = time.process_time()
        except ValueError:
            refused += 1
            continue
        finally:
            if profile:
                profile.disable()
        rows.append((end - start, converted - start, ruled - converted, end - ruled, len(grammar.rules), case["name"]))
    rows.sort(reverse=True)
    ms = [r[0] * 1e3 for r in rows]
    print(f"compiled {len(rows)}, refused {refused}; compile CPU ms p50 {np.percentile(ms, 50):.1f} "
          f"p90 {np.percentile(ms, 90):.1f} p99 {np.percentile(ms, 99):.1f} max {max(ms):.1f}; sum {sum(ms) / 1e3:.1f} s")
    for total, conv, rules, index, n, name in rows[:args.top]:
        print(f"{total * 1e3:8.1f} ms  conversion {conv * 1e3:7.1f}  rules {rules * 1e3:7.1f}  index {index * 1e3:6.1f}"
              f"  ({n} rules)  {name}")
    if profile:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
