"""Multi-turn chat: a system prompt shared by every conversation, then turns whose prompts hold the
whole conversation so far (the chat template's role markers included). Two variants, as in the paper:
short answers and long answers."""

from __future__ import annotations

import random
from typing import Any

import radixlm as sgl

from .common import paragraph, program_workload


@sgl.function
def multi_turn_chat(s, system_prompt, questions, answer_tokens):
    s += sgl.system(system_prompt)
    for i, question in enumerate(questions):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=answer_tokens))


def _chat_args(n: int, size: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    system_prompt = "You are a helpful assistant. " + paragraph(rng, size["system_sentences"])
    return [{"system_prompt": system_prompt,
             "questions": [paragraph(rng, size["question_sentences"]) for _ in range(size["turns"])],
             "answer_tokens": size["answer_tokens"]} for _ in range(n)]


CHAT_SHORT = program_workload(
    "chat_short", "Multi-turn chat, short answers", multi_turn_chat,
    sizes={"tiny": {"system_sentences": 3, "question_sentences": 1, "turns": 3, "answer_tokens": 3},
           "gpu": {"system_sentences": 8, "question_sentences": 8, "turns": 4, "answer_tokens": 8}},
    instances={"tiny": 4, "gpu": 256}, hf_instances={"gpu": 20}, make_args=_chat_args)

CHAT_LONG = program_workload(
    "chat_long", "Multi-turn chat, long answers", multi_turn_chat,
    sizes={"tiny": {"system_sentences": 3, "question_sentences": 1, "turns": 2, "answer_tokens": 12},
           "gpu": {"system_sentences": 8, "question_sentences": 8, "turns": 2, "answer_tokens": 64}},
    instances={"tiny": 3, "gpu": 256}, hf_instances={"gpu": 24}, make_args=_chat_args)
