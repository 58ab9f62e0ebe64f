"""The control: nothing shared. Each instance is one call on its own random text, with random prompt
and output lengths, to measure what the radix cache and cache-aware scheduling cost when there is
nothing to reuse."""

from __future__ import annotations

import random
from typing import Any

import radixlm as sgl

from .common import program_workload, words


@sgl.function
def control(s, prompt, output_tokens):
    s += prompt + sgl.gen("output", max_tokens=output_tokens)


def control_args(n: int, size: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    # A unique number first: no two prompts share even their first tokens.
    return [{"prompt": f"{rng.randrange(10**9)} " + words(rng, rng.randint(*size["prompt_words"])),
             "output_tokens": rng.randint(*size["output_tokens"])} for _ in range(n)]


CONTROL = program_workload(
    "control", "Control: no sharing, random prompt and output lengths", control,
    sizes={"tiny": {"prompt_words": (10, 60), "output_tokens": (4, 12)},
           "gpu": {"prompt_words": (100, 600), "output_tokens": (16, 96)}},
    instances={"tiny": 8, "gpu": 256}, hf_instances={"gpu": 64}, make_args=control_args, prefix_heavy=False)
