"""The mask path's shortcuts (issue 17's tail) against the slow ways they replace, on Qwen2's vocabulary:
exit suffixes taken per continuation (pda._suffixes_taken: suffix classes per terminal state, walked
through configurations only past a terminal's end) against stepping every suffix byte by byte; the
narrow trie walk against the level-wise one; single-byte successors against whole rows."""

from __future__ import annotations

import numpy as np
import pytest

from radixlm.core.constrained import build_constraint, grammar_index_cache, narrow_walk, terminal_tokens
from radixlm.core.constrained.grammar_index_cache import prepare_vocab
from radixlm.core.constrained.testing import qwen2_tokenizer, random_walk

SCHEMAS = [
    {"type": "object", "properties": {"customer_id": {"type": "integer", "minimum": 3},
                                      "price": {"type": "number", "exclusiveMaximum": 99.5},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b c", 7]}}},
     "required": ["customer_id"], "additionalProperties": {"type": "boolean"}},
    {"type": "array", "items": {"anyOf": [{"type": "string", "pattern": "^[a-z]+$"}, {"type": "null"},
                                          {"type": "object", "propertyNames": {"maxLength": 3}}]}},
    {"type": "object", "properties": {"foo": {"const": "x\"y"}, "fob": {"multipleOf": 3}},
     "additionalProperties": {"type": "string", "maxLength": 4}},
]


@pytest.fixture(scope="module")
def qwen():
    tokenizer = qwen2_tokenizer()
    prepare_vocab(tokenizer)
    return tokenizer


def _spells(index, state: int, data: bytes) -> bool:
    for b in data:
        state = index.byte_successors(state)[b]
        if state < 0:
            return False
    return True


@pytest.mark.parametrize("schema", SCHEMAS)
def test_exit_suffixes_taken_equal_stepping_every_suffix(schema, qwen):
    """At every configuration of random walks, each item's exit tokens taken from where its continuation
    resumes equal those whose suffix leads somewhere there, byte by byte through whole rows."""
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(6):
        c = build_constraint("json_schema", schema, qwen)
        index = c.index
        states = [index.start]
        for token in random_walk(build_constraint("json_schema", schema, qwen), rng, max_tokens=24):
            states.append(index.next_state(states[-1], token))
        for state in states:
            names, terminals = index.grammar.terminal_names, index.grammar.terminals
            for t, q, k in index._items[state]:
                classes = terminal_tokens.state_tokens(names[t], terminals[t], q, index.vocab)
                for exits in (classes.exits, classes.after_quote):
                    if exits is None:
                        continue
                    after = index._intern(index._follow(k))
                    suffixes = exits.tree.suffixes
                    alive = np.array([_spells(index, after, s) for s in suffixes], dtype=bool)
                    want = exits.pair_token[alive[exits.pair_suffix]]
                    assert sorted(index._exits_taken(exits, k).tolist()) == sorted(want.tolist())
                    checked += 1
    assert checked > 20


def test_narrow_walk_equals_the_level_wise_walk(qwen):
    """Wherever the node-by-node walk answers (literals, numbers, enums), it equals the level-wise walk of
    the same first-byte subtrees; it gives up on wide states (string bodies)."""
    vocab = prepare_vocab(qwen)
    first = vocab.trie.byte[1].astype(np.int64)
    answered = refused = 0
    for schema in SCHEMAS:
        grammar = build_constraint("json_schema", schema, qwen).index.grammar
        for name, dfa in zip(grammar.terminal_names, grammar.terminals):
            for q in range(min(len(dfa.transitions), 30)):
                nxt = dfa.transitions[q, first]
                live = np.flatnonzero(nxt >= 0)
                got = narrow_walk.narrow_walk(name, dfa, live, nxt[live], vocab)
                if got is None:
                    refused += 1
                    continue
                inside, uncertain = terminal_tokens._walk(dfa, live, nxt[live], vocab)
                assert got[0].tolist() == np.flatnonzero(inside).tolist(), (name, q)
                assert got[1].tolist() == sorted(uncertain.tolist()), (name, q)
                answered += 1
    assert answered > 50 and refused > 5


def test_single_byte_steps_agree_with_rows(qwen):
    """Successors computed one byte at a time (advancing) are those of the rows built afterwards."""
    rng = np.random.default_rng(1)
    checked = 0
    for schema in SCHEMAS:
        grammar_index_cache._cache.clear()  # a fresh index: no rows built by the tests above
        c = build_constraint("json_schema", schema, qwen)
        for _ in range(4):
            random_walk(build_constraint("json_schema", schema, qwen), rng, max_tokens=40)
        index = c.index
        steps = [dict(s) for s in index._steps]
        for config, stepped in enumerate(steps):
            for b, target in stepped.items():
                assert index._row(config)[b] == target, (config, b)
                checked += 1
    assert checked > 30
