"""`format: uri-template` (RFC 6570, a conservative subset) checked by jsonschema's format checker with the
`uri-template` package: given templates accepted or rejected as the checker says, and generated ones valid."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from radixlm.core.runtime.constrained import build_constraint
from radixlm.testing.constrained import random_walk
from radixlm.testing.constrained import accepts_text

uri_template = pytest.importorskip("uri_template")  # what jsonschema's checker uses for this format

SCHEMA = {"type": "string", "format": "uri-template"}  # no $schema: formats are asserted
VALID = ["http://example.com/{user}/repos{?page,per_page}", "{+path}/here", "{#frag:3}", "/{a.b}{/c*}", "%2F{x}", ""]
INVALID = ["{", "x}", "{a:0}", "{=a}", "{a:9999}", "{a b}", "{}"]


@pytest.fixture(scope="module")
def tiny_tokenizer(tokenizer_path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(tokenizer_path)


def _checker_valid(text: str) -> bool:
    return jsonschema.Draft7Validator(SCHEMA, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER).is_valid(text)


def test_given_templates(tiny_tokenizer):
    constraint = build_constraint("json_schema", SCHEMA, tiny_tokenizer)
    for text in VALID:
        assert _checker_valid(text) and accepts_text(constraint, json.dumps(text)), text
    for text in INVALID:
        assert not _checker_valid(text) and not accepts_text(constraint, json.dumps(text)), text


def test_generated_templates_are_valid(tiny_tokenizer):
    rng = np.random.default_rng(0)
    for _ in range(60):
        constraint = build_constraint("json_schema", SCHEMA, tiny_tokenizer)
        text = json.loads(tiny_tokenizer.decode(random_walk(constraint, rng, max_tokens=24),
                                                clean_up_tokenization_spaces=False))
        assert _checker_valid(text), text
