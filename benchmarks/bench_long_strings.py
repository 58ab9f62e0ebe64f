"""Mask cost inside long strings: every long_string_cases.py instance walked token by token over Qwen2's
vocabulary, each mask's thread CPU time kept (the vocabulary prepared and the heap frozen first, as an engine
does at start).

    python benchmarks/bench_long_strings.py

Prints per schema the tokens walked and the mask p50 / p99 / max in µs, and the masks over 2 ms.
"""

from __future__ import annotations

import array
import json
import time

import numpy as np
from long_string_cases import long_string_cases

from radixlm.core.runtime import gc_heap
from radixlm.core.runtime.constrained import build_constraint
from radixlm.core.runtime.constrained.grammar_index_cache import prepare_vocab
from radixlm.testing.constrained import qwen2_tokenizer


def main() -> None:
    tokenizer = qwen2_tokenizer()
    prepare_vocab(tokenizer)
    gc_heap.freeze_heap()  # as an engine does once its start-up tables are built (EngineOptions.gc_freeze)
    every = array.array("d")  # C doubles: a list of floats would be walked by every full collection
    for case in long_string_cases():
        times = array.array("d")
        for instance in case["valid"]:
            constraint = build_constraint("json_schema", case["schema"], tokenizer)
            text = json.dumps(instance, separators=(",", ":"), ensure_ascii=False)
            for token in tokenizer.encode(text, add_special_tokens=False):
                start = time.thread_time()
                constraint.allowed_token_mask(len(tokenizer), packed=True)
                times.append((time.thread_time() - start) * 1e6)
                constraint.advance(token)
        every += times
        print(f"{case['name']}: {len(times)} masks, p50 {np.percentile(times, 50):.1f} µs, "
              f"p99 {np.percentile(times, 99):.1f} µs, max {max(times):.0f} µs")
    print(f"all: {len(every)} masks, over 2 ms: {sum(t > 2000 for t in every)}, max {max(every):.0f} µs")


if __name__ == "__main__":
    main()
