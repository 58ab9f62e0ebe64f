"""A DSPy RAG-style pipeline through SGLangLM: retrieve passages for a question, then a few-shot
ChainOfThought("context, question -> answer") over them.

Every call starts with the same DSPy system prompt (the signature's instructions and fields) and the
same demos; the retrieved context and the question differ. A batch (`Module.batch`) reaches SGLangLM
from several threads at once and runs as one fork/join program. Replies are constrained to DSPy's
ChatAdapter format (SGLangLM's constrain_format), each free-text field bounded, so that the random
model's replies parse. DSPy is imported only when this workload runs.
"""

from __future__ import annotations

import os
import random
from typing import Any

from .common import Workload, paragraph, sentence


def retrieve(corpus: list[str], question: str, k: int) -> list[str]:
    """The k passages sharing most words with the question (ties: corpus order)."""
    asked = set(question.lower().rstrip(".").split())
    ranked = sorted(range(len(corpus)), key=lambda i: -len(asked & set(corpus[i].lower().split())))
    return [corpus[i] for i in ranked[:k]]


def _dspy() -> Any:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # DSPy's LiteLLM: no price-list download
    import dspy

    return dspy


def _rag_module(args: dict[str, Any]) -> Any:
    dspy = _dspy()

    class RAG(dspy.Module):
        def __init__(self) -> None:
            super().__init__()
            self.respond = dspy.ChainOfThought("context, question -> answer")
            self.respond.predict.demos = [dspy.Example(**demo) for demo in args["demos"]]

        def forward(self, question: str) -> Any:
            context = retrieve(args["corpus"], question, args["k"])
            return self.respond(context=context, question=question)

    return RAG()


def _lm(backend: Any, args: dict[str, Any]) -> Any:
    from radixlm.adapters.dspy import SGLangLM

    return SGLangLM(engine=backend, temperature=0.0, max_tokens=args["max_tokens"],
                    max_field_chars=args["max_field_chars"])


def run_one(backend: Any, args: dict[str, Any]) -> Any:
    dspy = _dspy()

    with dspy.context(lm=_lm(backend, args), adapter=dspy.ChatAdapter()):
        return _rag_module(args)(question=args["question"])


def run_batch(backend: Any, batch: list[dict[str, Any]]) -> list[Any]:
    dspy = _dspy()

    examples = [dspy.Example(question=a["question"]).with_inputs("question") for a in batch]
    with dspy.context(lm=_lm(backend, batch[0]), adapter=dspy.ChatAdapter()):
        results = _rag_module(batch[0]).batch(examples, num_threads=len(batch), disable_progress_bar=True,
                                               return_failed_examples=True)
    predictions, failed, errors = results
    if failed:
        raise RuntimeError(f"{len(failed)} DSPy programs failed, e.g. {errors[0]!r}")
    return predictions


def make_args(n: int, size: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    corpus = [paragraph(rng, size["passage_sentences"]) for _ in range(size["corpus"])]
    demos = []
    for _ in range(size["demos"]):
        question = sentence(rng, 6, 12)
        demos.append({"context": retrieve(corpus, question, size["k"]), "question": question,
                      "reasoning": sentence(rng, 8, 16), "answer": sentence(rng, 2, 6)})
    shared = {"corpus": corpus, "demos": demos, "k": size["k"], "max_tokens": size["max_tokens"],
              "max_field_chars": size["max_field_chars"]}
    return [{**shared, "question": sentence(rng, 6, 12)} for _ in range(n)]


DSPY_RAG = Workload(
    "dspy_rag", "DSPy RAG pipeline through SGLangLM: shared instructions and demos, retrieved context",
    sizes={"tiny": {"corpus": 12, "passage_sentences": 1, "demos": 2, "k": 2, "max_tokens": 48,
                    "max_field_chars": 12},
           "gpu": {"corpus": 64, "passage_sentences": 3, "demos": 3, "k": 3, "max_tokens": 128,
                   "max_field_chars": 64}},
    instances={"tiny": 3, "gpu": 128}, hf_instances={"gpu": 32}, make_args=make_args, run_one=run_one,
    run_batch=run_batch, requires=["dspy"])
