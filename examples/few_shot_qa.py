"""Few-shot question answering: one program, run alone and as a batch that shares its prefix.

    python examples/few_shot_qa.py                          # the embedded SmolLM2-135M-Instruct
    python examples/few_shot_qa.py --model-path PATH_OR_HUB_ID

The same file runs on SGLang with `import sglang as sgl`.
"""

from __future__ import annotations

import argparse
from typing import Any

import radixlm as sgl


@sgl.function
def few_shot_qa(s, question):
    s += "The following are questions with answers.\n\n"
    s += "Q: What is the capital of France?\nA: Paris\n"
    s += "Q: What is the capital of Germany?\nA: Berlin\n"
    s += "Q: What is the capital of Italy?\nA: Rome\n"
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", max_tokens=16)


QUESTIONS = ["What is the capital of Japan?", "What is the capital of the United Kingdom?",
             "What is the capital city of China?"]


def main(argv: list[str] | None = None, backend: Any = None) -> list[Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="checkpoint folder, .gguf file or hub id (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args(argv)
    engine = None
    if backend is None:
        backend = engine = sgl.Engine(args.model_path)
    sgl.set_default_backend(backend)
    try:
        state = few_shot_qa.run(question="What is the capital of Spain?", temperature=0)
        print(f"answer: {state['answer']!r}")
        # The batch's common prefix (the few-shot examples) is found by tracing and prefilled once.
        states = few_shot_qa.run_batch([{"question": q} for q in QUESTIONS], temperature=0)
        for q, st in zip(QUESTIONS, states):
            info = st.get_meta_info("answer")
            print(f"{q} -> {st['answer']!r} ({info['cached_tokens']} of {info['prompt_tokens']} prompt tokens cached)")
        return [state, *states]
    finally:
        if engine is not None:
            engine.shutdown()


if __name__ == "__main__":
    main()
