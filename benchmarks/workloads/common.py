"""What every workload shares: the Workload record, synthetic text, and how a program is run.

The text is made of common English words drawn by a seeded generator, so every run (and every system
in a run) sees exactly the same prompts, and nothing is downloaded. Only the token-sharing structure of
the paper's workloads matters here: which parts of the prompts are shared, by how many calls, and how
long the generated parts are. The models have random weights, so the words carry no meaning.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which this be or had "
    "not but one all their there been has they have who new more also when after first some other time "
    "two over into only most many year years these may would than then such about any used can its made "
    "between both under while during where each through three since before well known city group state "
    "world part later called work found people water small house river north south school system music "
    "book game team early long large high old name number place play life family second company area "
    "series film history member order power point light line field story form level "
    "report model answer question reason result value energy church court local public general human "
    "night party road station island village garden paper letter window forest mountain valley bridge "
    "doctor teacher student record office table summer winter morning evening country"
).split()

# Default sampling for every gen: greedy and deterministic, and generation lengths fixed by each
# gen's max_tokens (random weights would otherwise stop at arbitrary points), so every system does
# the same work.
RUN_SAMPLING = {"temperature": 0.0, "ignore_eos": True}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    text = words(rng, rng.randint(lo, hi))
    return text[0].upper() + text[1:] + "."


def paragraph(rng: random.Random, n_sentences: int, lo: int = 6, hi: int = 14) -> str:
    return " ".join(sentence(rng, lo, hi) for _ in range(n_sentences))


@dataclass
class Workload:
    """One of the paper's workloads.

    `make_args(n, size, rng)` builds the arguments of n program instances for the size preset `size`
    (a dict of lengths). `run_one(backend, args)` runs one instance to completion; `run_batch(backend,
    batch)` runs all of them at once (run_batch with every program in flight). Both take any object
    the program model accepts as a backend: a radixlm.Engine or an engine-shaped peer.

    `instances` sizes the radixlm systems' throughput runs; `hf_instances` the HF peer's, which runs
    the first that many of the same instances (a preset missing there: all of them). `engine_options`
    (size preset -> Engine options) gives the workload an engine of its own with those options (the
    order-sensitive workload's small KV pool)."""

    name: str
    description: str
    sizes: dict[str, dict[str, Any]]  # preset name ("tiny", "gpu") -> lengths
    instances: dict[str, int]  # preset name -> default number of program instances
    hf_instances: dict[str, int]  # preset name -> instances the HF peer runs (missing: all)
    make_args: Callable[[int, dict[str, Any], random.Random], list[dict[str, Any]]]
    run_one: Callable[[Any, dict[str, Any]], Any]
    run_batch: Callable[[Any, list[dict[str, Any]]], list[Any]]
    prefix_heavy: bool = True
    requires: list[str] = field(default_factory=list)  # Python packages it needs beyond radixlm's
    engine_options: dict[str, dict[str, Any]] = field(default_factory=dict)


def program_workload(name: str, description: str, program: Any, sizes: dict[str, dict[str, Any]],
                     instances: dict[str, int], hf_instances: dict[str, int],
                     make_args: Callable[[int, dict[str, Any], random.Random], list[dict[str, Any]]],
                     prefix_heavy: bool = True, engine_options: dict[str, dict[str, Any]] | None = None) -> Workload:
    """A workload that is one @sgl.function, run with run / run_batch."""

    def run_one(backend: Any, args: dict[str, Any]) -> Any:
        state = program.run(backend=backend, **args, **RUN_SAMPLING)
        state.sync()
        _raise_error(state)
        return state

    def run_batch(backend: Any, batch: list[dict[str, Any]]) -> list[Any]:
        states = program.run_batch(batch, backend=backend, num_threads=len(batch), **RUN_SAMPLING)
        for state in states:
            _raise_error(state)
        return states

    return Workload(name, description, sizes, instances, hf_instances, make_args, run_one, run_batch, prefix_heavy,
                    engine_options=engine_options or {})


def _raise_error(state: Any) -> None:
    if state.error() is not None:
        raise RuntimeError(f"a program failed: {state.error()!r}") from state.error()


class TokenizerEncoding:
    """The part of an Engine's surface that the program backend calls (`encode`, `images`), for the
    engine-shaped stand-ins to inherit: prompts tokenized as radixlm's Engine does."""

    images = None  # text models only: no image preparation

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def generate_inputs(tokenizer: Any, prompt: Any, input_ids: Any,
                    sampling_params: Any) -> tuple[bool, list[list[int]], list[dict[str, Any]]]:
    """An Engine.generate call's inputs as (single, one id list per prompt, one params dict per
    prompt), for the engine-shaped stand-ins (the HF driver, the estimator's NullEngine)."""
    single = isinstance(prompt, str) or (input_ids is not None and bool(input_ids) and isinstance(input_ids[0], int))
    if prompt is not None:
        id_lists = [TokenizerEncoding(tokenizer).encode(p) for p in ([prompt] if single else prompt)]
    else:
        id_lists = [input_ids] if single else input_ids
    params = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(id_lists)
    return single, id_lists, params

