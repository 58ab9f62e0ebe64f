"""Few-shot benchmarks: MMLU 5-shot (one output token) and HellaSwag 20-shot (select over 4 endings).

MMLU: every question of a subject starts with the same header and five solved examples; only the
question differs, and the answer is one token. HellaSwag: every question starts with the same 20
solved examples; the model picks the most likely of four endings (one prefill of the prefix, then
the four endings scored together)."""

from __future__ import annotations

import random
from typing import Any

import radixlm as sgl

from .common import paragraph, program_workload, sentence, words

LETTERS = "ABCD"


@sgl.function
def mmlu(s, examples, question):
    s += examples + question
    s += sgl.gen("answer", max_tokens=1)


def _mmlu_question(rng: random.Random, size: dict[str, Any], answer: str | None) -> str:
    text = sentence(rng, size["question_words"], size["question_words"] + 8) + "\n"
    for letter in LETTERS:
        text += f"{letter}. {words(rng, rng.randint(2, size['option_words']))}\n"
    return text + "Answer:" + (f" {answer}\n\n" if answer else "")


def mmlu_args(n: int, size: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    prefixes = []
    for i in range(size["subjects"]):
        subject = f"{words(rng, 2)} {i}"
        header = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
        prefixes.append(header + "".join(_mmlu_question(rng, size, rng.choice(LETTERS)) for _ in range(5)))
    # Questions are interleaved across subjects, as a benchmark harness iterating a shuffled set would.
    return [{"examples": prefixes[i % len(prefixes)], "question": _mmlu_question(rng, size, None)}
            for i in range(n)]


MMLU = program_workload(
    "mmlu", "MMLU 5-shot: per-subject five-example prefix, one output token", mmlu,
    sizes={"tiny": {"subjects": 2, "question_words": 6, "option_words": 3},
           "gpu": {"subjects": 4, "question_words": 32, "option_words": 6}},
    instances={"tiny": 8, "gpu": 256}, hf_instances={"gpu": 64}, make_args=mmlu_args)


@sgl.function
def hellaswag(s, examples, context, endings):
    s += examples + context
    s += sgl.select("ending", choices=endings)


def hellaswag_args(n: int, size: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    def item() -> tuple[str, list[str]]:
        context = f"{words(rng, 2).title()}: " + paragraph(rng, size["context_sentences"], size["context_words"] // 2,
                                                           size["context_words"])
        return context, [" " + sentence(rng, size["ending_words"] // 2, size["ending_words"]) for _ in range(4)]

    shots = []
    for _ in range(20):
        context, endings = item()
        shots.append(context + rng.choice(endings) + "\n\n")
    examples = "".join(shots)
    return [dict(zip(("context", "endings"), item()), examples=examples) for _ in range(n)]


HELLASWAG = program_workload(
    "hellaswag", "HellaSwag 20-shot: one shared 20-example prefix, select over 4 endings", hellaswag,
    sizes={"tiny": {"context_sentences": 1, "context_words": 6, "ending_words": 4},
           "gpu": {"context_sentences": 2, "context_words": 10, "ending_words": 8}},
    instances={"tiny": 4, "gpu": 64}, hf_instances={"gpu": 16}, make_args=hellaswag_args)
