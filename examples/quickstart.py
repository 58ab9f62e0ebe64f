"""Runs a batch of prompts that share a long prefix and shows the radix cache reusing it.

    python examples/quickstart.py [--model-path /path/to/hf/checkpoint]

Without --model-path the embedded tiny default model is used: its weights are random, so the text
is meaningless, but the prefix reuse, the timings and the stats are real.
"""

import argparse
import time

import radixlm

SYSTEM = (
    "You are a helpful assistant for a harbour town. Answer in one short sentence, and mention the "
    "weather if it matters. Here are three examples of good answers: the ferry leaves at nine; the "
    "market is closed on Sundays; the lighthouse is open to visitors when the sea is calm.\n"
)
QUESTIONS = ["When does the ferry leave?", "Is the market open today?", "Can I visit the lighthouse?",
             "Where can I buy fish?", "Is it safe to swim?", "What time is high tide?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()

    with radixlm.Engine(model_path=args.model_path, log_level="info") as engine:
        prompts = [f"{SYSTEM}Q: {q}\nA:" for q in QUESTIONS]
        start = time.perf_counter()
        outputs = engine.generate(prompts, {"max_new_tokens": args.max_new_tokens, "temperature": 0})
        elapsed = time.perf_counter() - start
        for q, out in zip(QUESTIONS, outputs):
            meta = out["meta_info"]
            print(f"{q}\n  -> {out['text']!r}\n     prompt {meta['prompt_tokens']} tokens, "
                  f"{meta['cached_tokens']} from the radix cache, {meta['completion_tokens']} generated")
        stats = engine.get_stats()
        print(f"\n{len(prompts)} requests in {elapsed:.2f} s; cache hit rate {stats['cache_hit_rate']:.1%}; "
              f"{stats['generated_tokens_total'] / elapsed:.0f} generated tokens/s")


if __name__ == "__main__":
    main()
