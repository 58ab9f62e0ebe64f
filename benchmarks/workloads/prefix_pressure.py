"""Order-sensitive by construction (the paper's case for cache-aware scheduling): more distinct long
shared prefixes (documents) than the KV pool holds, each shared by several questions, the questions
arriving interleaved across documents (document i % documents for instance i).

In arrival order the engine computes a document, runs out of memory before that document's other
questions come up, evicts it for the next documents, and computes it again later; an order that
takes the questions whose document is still cached first computes each document about once. The
workload's engine gets a KV pool of `kv_pool_tokens` (engine_options), about a quarter of the
documents' tokens, so the pressure does not depend on the device's memory."""

from __future__ import annotations

import random
from typing import Any

import radixlm as sgl

from .common import paragraph, program_workload


@sgl.function
def document_question(s, document, question, answer_tokens):
    s += "Read the document, then answer the question.\n\n" + document + "\n\nQuestion: " + question + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=answer_tokens)


def prefix_pressure_args(n: int, size: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    documents = [f"Document {i}. " + paragraph(rng, size["document_sentences"]) for i in range(size["documents"])]
    return [{"document": documents[i % len(documents)], "question": paragraph(rng, 1),
             "answer_tokens": size["answer_tokens"]} for i in range(n)]


PREFIX_PRESSURE = program_workload(
    "prefix_pressure", "Interleaved questions over more long documents than the KV pool holds (order-sensitive)",
    document_question,
    sizes={"tiny": {"documents": 8, "document_sentences": 12, "answer_tokens": 4},
           "gpu": {"documents": 32, "document_sentences": 64, "answer_tokens": 32}},
    instances={"tiny": 32, "gpu": 256}, hf_instances={"gpu": 16}, make_args=prefix_pressure_args,
    # About a third of the documents' tokens (~290 a document at tiny size, ~1500 at gpu size).
    engine_options={"tiny": {"max_total_tokens": 1024}, "gpu": {"max_total_tokens": 16384}})
