"""Constrained decoding through radixlm.Engine on the tiny default model (random weights): sampled
outputs checked with `re` and `jsonschema`, jump-forward against decoding without it."""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import pytest

import radixlm
from radixlm.core.runtime.constrained import build_constraint, grammar_to_regex, json_schema_to_grammar, regex_to_dfa
from radixlm.core.runtime.constrained.tokens.vocab import vocab_of
from radixlm.core.errors import InvalidRequestError
from radixlm.testing.checkpoints import tiny_model_path
from test_constrained_json import SCHEMAS, _schema_dict
from test_constrained_regex import REGEXES

SAMPLES = 3  # per pattern, at temperature 1: 3 x 63 regexes and 3 x 37 schemas
MAX_NEW = 64


@pytest.fixture(scope="module")
def engine():
    # A random model: the harshest sampler. The compile budget is the test's business elsewhere
    # (test_server_limits); here a loaded CI machine must not turn a slow compile into a failure.
    with radixlm.Engine(tiny_model_path(), debug_check_invariants=True, grammar_max_compile_seconds=60) as e:
        yield e


def _sample(engine, kind: str, specs: list) -> list[tuple[object, dict]]:
    params = [{kind: spec, "n": SAMPLES, "temperature": 1.0, "max_new_tokens": MAX_NEW, "seed": i}
              for i, spec in enumerate(specs)]
    outs = engine.generate([f"Sample {i}:" for i in range(len(specs))], params)
    return [(spec, out) for i, spec in enumerate(specs) for out in outs[i * SAMPLES:(i + 1) * SAMPLES]]


def _check_prefix(engine, pattern: str, out: dict) -> None:
    """An output cut by max_new_tokens (maybe inside a character) must still be the start of a match."""
    token_bytes = vocab_of(engine.tokenizer).token_bytes
    assert _dfa(pattern).walk(b"".join(token_bytes[t] for t in out["output_ids"])) >= 0, out["text"]


@functools.lru_cache(maxsize=None)
def _dfa(pattern: str):
    return regex_to_dfa(pattern)


@functools.lru_cache(maxsize=None)
def _deep_regex(spec: str) -> str:
    """The schema's grammar as one regex (grammar_to_regex), its recursion cut 10 levels down: deep enough
    for any 64-token output (any value, whose rule branches 4 ways a level, 3 levels down: 10 would pass the
    length limit). Its byte DFA is built apart from the index that sampled (no token tables)."""
    grammar = json_schema_to_grammar(spec)
    try:
        return grammar_to_regex(grammar, max_depth=10)
    except ValueError:
        return grammar_to_regex(grammar, max_depth=3)


def test_sampled_regex_outputs_fullmatch(engine):
    stopped = 0
    for pattern, out in _sample(engine, "regex", REGEXES):
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            assert re.fullmatch(pattern, out["text"]), (pattern, out["text"])
            stopped += 1
        else:
            _check_prefix(engine, pattern, out)
    assert stopped >= len(REGEXES) * SAMPLES * 0.6  # most end by themselves


def test_sampled_json_outputs_validate(engine):
    specs = [json.dumps(_schema_dict(s)) if not isinstance(s, bool) else json.dumps(s) for s in SCHEMAS]
    stopped = 0
    for spec, out in _sample(engine, "json_schema", specs):
        schema = json.loads(spec)
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            validator = jsonschema.validators.validator_for(schema)
            validator(schema, format_checker=validator.FORMAT_CHECKER).validate(json.loads(out["text"]))
            stopped += 1
        else:
            _check_prefix(engine, _deep_regex(spec), out)
    assert stopped >= len(SCHEMAS) * SAMPLES * 0.5


def test_choices_and_invalid_constraints(engine):
    outs = engine.generate(["Pick:"] * 8, {"choices": ["red", "green", "blue"], "temperature": 1.0, "seed": 3})
    assert {o["text"] for o in outs} <= {"red", "green", "blue"}
    before = engine.get_stats()["requests_total"]
    for params, name in [({"regex": r"(a)\1"}, "backreference"), ({"json_schema": "{oops"}, "not valid JSON"),
                         ({"json_schema": json.dumps({"not": {"format": "email"}})}, "'not'"), ({"choices": []}, "choices")]:
        with pytest.raises(InvalidRequestError, match=re.escape(name)):
            engine.generate("x", params)
    assert engine.get_stats()["requests_total"] == before  # rejected before anything was queued


# Forced text made of characters that no token of the tiny vocabulary joins (control characters and
# lone capitals between them): the only tokens that spell it are its single characters, so decoding
# without jump-forward must produce exactly the canonical tokens jump-forward inserts.
CANONICAL_FORCED = [
    r"[a-z]{1,4}\x01Q\x02Z\x03[0-9]{1,2}\x04R\x05W\x06",
    r"[k-m]\x01K\x02J\x03[\x11\x12]\x04X\x05",
    r"[0-9]{2}\x07V\x08Y\x0e[a-c]\x0fU\x10",
]


def _jump_consistent(pattern: str, tokens: list[int], tokenizer) -> bool:
    """Whether `tokens` (decoded without jump-forward) are what jump-forward would have written: replays
    them, and wherever jump-forward would jump, compares its tokens with the ones decoded."""
    c = build_constraint("regex", pattern, tokenizer)
    out: list[int] = []
    plan = c.jump_forward(out, tokenizer, max_replace=0)
    while True:
        if plan is not None:
            k, new = plan
            out = out[: len(out) - k] + new
            if tokens[: len(out)] != out:
                return False
        if len(out) >= len(tokens) or c.is_finished():
            return out == tokens[: len(out)]
        c.advance(tokens[len(out)])
        out.append(tokens[len(out)])
        plan = None if c.is_finished() else c.jump_forward(out, tokenizer, max_replace=1)


def test_greedy_output_same_with_and_without_jump_forward(engine):
    """Equal whenever the forced text comes out canonically without jump-forward too; the patterns above
    make that the case every time, so the comparison is never skipped."""
    jumped = 0
    for i, pattern in enumerate(CANONICAL_FORCED):
        prompt = f"Case {i}:"
        base = {"regex": pattern, "temperature": 0, "max_new_tokens": 64}
        plain = engine.generate(prompt, base | {"disable_jump_forward": True})
        before = engine.get_stats()["generated_tokens_total"]
        fast = engine.generate(prompt, base)
        steps = engine.get_stats()["generated_tokens_total"] - before
        assert _jump_consistent(pattern, plain["output_ids"], engine.tokenizer), plain["text"]
        assert fast["output_ids"] == plain["output_ids"] and fast["text"] == plain["text"]
        assert re.fullmatch(pattern, fast["text"])
        jumped += len(fast["output_ids"]) - steps
    assert jumped >= len(CANONICAL_FORCED) * 3  # several tokens per case came from jump-forward


def test_greedy_jump_forward_differs_only_where_decoding_was_not_canonical(engine):
    """Where decoding without jump-forward spelled forced text with other tokens than the canonical
    ones (here "down" as d-o-w-n), the outputs may differ; both still match."""
    pattern = r"(yes|no)\x01K\x02(up|down|sideways)\x03"
    base = {"regex": pattern, "temperature": 0, "max_new_tokens": 32}
    for i in range(2):
        plain = engine.generate(f"Other {i}:", base | {"disable_jump_forward": True})
        fast = engine.generate(f"Other {i}:", base)
        assert re.fullmatch(pattern, plain["text"]) and re.fullmatch(pattern, fast["text"])
        if _jump_consistent(pattern, plain["output_ids"], engine.tokenizer):
            assert fast["output_ids"] == plain["output_ids"]


FIXED_KEYS = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Berlin", "Lisbon"]},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "member", "tags"],
    "additionalProperties": False,
}


def _decode_steps(engine, params: dict, n: int) -> tuple[int, int, list[dict]]:
    before = engine.get_stats()["generated_tokens_total"]
    outs = engine.generate([f"Person {i}:" for i in range(n)], [params | {"seed": i} for i in range(n)])
    steps = engine.get_stats()["generated_tokens_total"] - before
    return steps, sum(len(o["output_ids"]) for o in outs), outs


def test_jump_forward_saves_decode_steps_on_fixed_keys(engine, capsys):
    params = {"json_schema": json.dumps(FIXED_KEYS), "temperature": 1.0, "max_new_tokens": 128}
    steps_jf, tokens_jf, outs_jf = _decode_steps(engine, params, 8)
    steps_plain, tokens_plain, outs_plain = _decode_steps(engine, params | {"disable_jump_forward": True}, 8)
    for out in outs_jf + outs_plain:
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        jsonschema.validate(json.loads(out["text"]), FIXED_KEYS)
    assert steps_plain == tokens_plain  # without it every output token is a decode step
    forced_fraction = 1 - steps_jf / tokens_jf
    with capsys.disabled():
        print(f"\njump-forward on fixed-key JSON: {steps_jf} decode steps for {tokens_jf} tokens "
              f"({forced_fraction:.0%} jumped); without: {steps_plain} steps for {tokens_plain} tokens")
    assert forced_fraction > 0.3
    assert steps_jf / len(outs_jf) < 0.75 * steps_plain / len(outs_plain)


def test_engine_option_disables_jump_forward():
    with radixlm.Engine(tiny_model_path(), disable_jump_forward=True) as e:
        steps, tokens, outs = _decode_steps(e, {"json_schema": json.dumps(FIXED_KEYS), "temperature": 1.0,
                                                "max_new_tokens": 128}, 4)
    assert steps == tokens
    for out in outs:
        jsonschema.validate(json.loads(out["text"]), FIXED_KEYS)


def test_cached_tokens_count_the_prompt_only_when_forced_output_is_cached_too(engine):
    # The regex forces its first tokens, appended before the first step; on a repeat the cache holds
    # them after the prompt, but cached_tokens is a count of prompt tokens (it read 14 of 9 before).
    prompt, params = "a repeated question", {"regex": "Answer: the value is [0-9]+", "temperature": 0,
                                             "max_new_tokens": 8}
    engine.flush_cache()
    first = engine.generate(prompt, params)["meta_info"]
    again = engine.generate(prompt, params)["meta_info"]
    assert first["cached_tokens"] == 0
    assert again["cached_tokens"] == again["prompt_tokens"] == first["prompt_tokens"]

def test_streaming_with_jump_forward(engine):
    chunks = list(engine.generate("Stream:", {"json_schema": json.dumps(FIXED_KEYS), "temperature": 1.0,
                                              "max_new_tokens": 128, "seed": 5}, stream=True))
    text = "".join(c["text"] for c in chunks)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    jsonschema.validate(json.loads(text), FIXED_KEYS)


def test_engine_resolves_refs_to_registered_schema_documents(engine, tmp_path):
    """json_schema_documents: a request schema's $ref to another document, by that document's $id, compiles
    and every sample validates against jsonschema resolving the same document; without the document the
    ref is a clear error."""
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    person = {"$id": "https://schemas.example.com/person.json", "type": "object",
              "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0}},
              "required": ["name", "age"], "additionalProperties": False}
    (tmp_path / "person.json").write_text(json.dumps(person))
    schema = {"type": "array", "items": {"$ref": "https://schemas.example.com/person.json"},
              "minItems": 1, "maxItems": 2}
    with pytest.raises(InvalidRequestError, match="json_schema_documents"):  # not registered yet
        engine.generate("People:", {"json_schema": json.dumps(schema), "max_new_tokens": 4})
    registry = Registry().with_resource(person["$id"], Resource.from_contents(person, DRAFT202012))
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    with radixlm.Engine(tiny_model_path(), json_schema_documents=str(tmp_path),
                        grammar_max_compile_seconds=60) as e:
        params = {"json_schema": json.dumps(schema), "temperature": 1.0, "max_new_tokens": 96, "n": 4, "seed": 3}
        outs = e.generate("People:", params)
    finished = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert finished
    for out in finished:
        validator.validate(json.loads(out["text"]))
