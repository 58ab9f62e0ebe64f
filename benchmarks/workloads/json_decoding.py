"""JSON decoding with regular expressions: extract facts from a document into a fixed JSON layout.

The instruction (with one worked example) is shared by every document; each document is shared by
all the fields extracted from it. The JSON's constant text (keys, quotes, punctuation) is appended by
the program between fields, and every field is a gen constrained by a regex, so each call's prompt is
the document plus the JSON written so far."""

from __future__ import annotations

import random
from typing import Any

import radixlm as sgl

from .common import paragraph, program_workload, words

NAME = r"[A-Z][a-z]{2,9}( [A-Z][a-z]{2,9})?"
FIELDS = [  # (key, regex, quoted)
    ("name", NAME, True),
    ("founded", r"1[0-9]{3}", False),
    ("country", NAME, True),
    ("population", r"[1-9][0-9]{2,7}", False),
    ("capital", NAME, True),
    ("motto", r"[a-z]{2,9}( [a-z]{2,9}){1,4}", True),
]


@sgl.function
def json_decode(s, instruction, document, field_tokens):
    s += instruction + "Document:\n" + document + "\nJSON:\n{"
    for i, (key, regex, quoted) in enumerate(FIELDS):
        quote = '"' if quoted else ""
        s += ("," if i else "") + f'\n  "{key}": {quote}'
        s += sgl.gen(key, max_tokens=field_tokens, regex=regex) + quote
    s += "\n}\n"


def _example(rng: random.Random) -> str:
    values = {"name": words(rng, 1).title(), "founded": "1864", "country": words(rng, 1).title(),
              "population": "52000", "capital": words(rng, 1).title(), "motto": words(rng, 3)}
    return "{" + ",".join(f'\n  "{k}": ' + (f'"{values[k]}"' if q else values[k]) for k, _, q in FIELDS) + "\n}\n"


def json_args(n: int, size: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    instruction = ("Extract the facts about the place described in the document into JSON with the keys "
                   + ", ".join(k for k, _, _ in FIELDS) + ".\nExample document:\n"
                   + paragraph(rng, size["document_sentences"]) + "\nJSON:\n" + _example(rng) + "\n")
    return [{"instruction": instruction, "document": paragraph(rng, size["document_sentences"]),
             "field_tokens": size["field_tokens"]} for _ in range(n)]


JSON_DECODING = program_workload(
    "json_decoding", "JSON decoding: shared instruction, per-document prefix, constant text between regex fields",
    json_decode,
    sizes={"tiny": {"document_sentences": 2, "field_tokens": 12},
           "gpu": {"document_sentences": 12, "field_tokens": 12}},
    instances={"tiny": 4, "gpu": 128}, hf_instances={"gpu": 12}, make_args=json_args)
