"""The mask path's shortcuts (issue 17's tail) against the slow ways they replace, on Qwen2's vocabulary:
exit suffixes taken per continuation (pda._suffixes_taken: suffix classes per terminal state, walked
through configurations only past a terminal's end) against stepping every suffix byte by byte; the
narrow trie walk against the level-wise one; single-byte successors against whole rows; exit pairs, counted
string classes, state rows and future names against the direct ways."""

from __future__ import annotations

import functools
import gc

import numpy as np
import pytest

from radixlm.core.runtime.constrained import build_constraint, grammar_index_cache
from radixlm.core.runtime.constrained.tokens import first_nodes, narrow_walk, terminal_tokens, token_walk, trie_walk
from radixlm.core.runtime.constrained.automata.grammar_compiler import GrammarBudget, compile_grammar
from radixlm.core.runtime.constrained.grammar_index_cache import prepare_vocab
from radixlm.core.runtime.constrained.tokens.literal_tokens import literal_rest
from radixlm.core.runtime.constrained.tokens.token_classes import AFTER_QUOTE, CLOSING, EXITS, INSIDE, INSIDE_IDS
from radixlm.core.runtime.constrained.tokens import vocab as vocab_mod
from radixlm.core.runtime.constrained.tokens.vocab import TokenVocab, byte_matrix
from radixlm.core.runtime.constrained.automata.regex_dfa import regex_to_dfa
from radixlm.core.runtime.constrained.pda import GrammarIndex
from radixlm.testing.constrained import qwen2_tokenizer, random_walk
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.errors import InvalidRequestError

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
    checked, trees = 0, []
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
                for exits in (classes[EXITS], classes[AFTER_QUOTE]):
                    if exits is None:
                        continue
                    after = index._intern(index._follow(k))
                    suffixes = exits.tree.suffixes
                    alive = np.array([_spells(index, after, s) for s in suffixes], dtype=bool)
                    want = exits.pair_token[alive[exits.pair_suffix]]
                    assert sorted(index._exits_taken(exits, k).tolist()) == sorted(want.tolist())
                    trees.append(exits.tree)
                    checked += 1
    assert checked > 20
    # The trees' nodes are numbers in dicts and tuples, which a collection leaves untracked: a full
    # collection walks two lists a tree, not objects per node.
    gc.collect()
    assert not any(gc.is_tracked(x) for tree in trees for part in tree.nodes for x in part)


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
                inside, uncertain = trie_walk.walk_trie(name, dfa, live, nxt[live], vocab)
                assert got[0].tolist() == np.flatnonzero(inside).tolist(), (name, q)
                assert got[1].tolist() == sorted(uncertain.tolist()), (name, q)
                answered += 1
    assert answered > 50 and refused > 5


@functools.lru_cache(maxsize=1)
def _vocab_matrix(vocab) -> tuple[np.ndarray, np.ndarray]:
    return byte_matrix(vocab.token_bytes)


def _read_each_token(dfa, q: int, vocab) -> tuple[np.ndarray, np.ndarray]:
    """The oracle of trie_walk.walk_trie, token by token (no trie): every token of the vocabulary read
    from state q, one numpy step per byte position over all tokens at once: (bool [vocab]: alive through
    its last byte, sorted ids of the others that pass an accepting state after 1 <= j < len bytes)."""
    mat, lens = _vocab_matrix(vocab)
    cur = np.full(vocab.size, q, dtype=np.int64)
    exits = np.zeros(vocab.size, dtype=bool)
    for j in range(mat.shape[1]):
        reading = (cur >= 0) & (lens > j)
        if j >= 1:
            exits |= reading & dfa.accepting[np.maximum(cur, 0)]
        cur = np.where(reading, dfa.transitions[np.maximum(cur, 0), mat[:, j]], cur)
    inside = (cur >= 0) & (lens > 0)
    return inside, np.flatnonzero(exits & ~inside)


@pytest.mark.parametrize("pattern", [r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])*"', r'"[A-Za-z][A-Za-z0-9+.-]*://[a-z]*"',
                                     r'"[a-z](?:[0-9a-z_]|-)*"', r'a.*b?', r'(?:[a-z ]+x)*', r'-+[0-9]*',
                                     r'"[^"\\é]*"'])
def test_trie_walk_equals_reading_each_token(pattern, qwen, monkeypatch):
    """The level-wise walk, with the subtrees it takes whole (the state loops on every byte below) and
    its node-by-node tail, against reading every token's bytes: string bodies, patterns with loops,
    accepting loops (every token below an exit), long runs of one byte (`-----`); states every whole UTF-8
    character returns to (taken whole over non-ASCII bytes) and a body that excludes one character (not).
    The walk a token at a time (token_walk.py) against both, made
    to answer whatever it leaves to read byte by byte."""
    monkeypatch.setattr(token_walk, "REST_MOST", 1 << 30)
    vocab = prepare_vocab(qwen)
    dfa = regex_to_dfa(pattern)
    first = vocab.trie.byte[1].astype(np.int64)
    tokens_read = 0
    for q in range(min(dfa.num_states, 6)):
        nxt = dfa.transitions[q, first]
        live = np.flatnonzero(nxt >= 0)
        inside, uncertain = trie_walk.walk_trie(pattern, dfa, live, nxt[live], vocab)
        want_inside, want_uncertain = _read_each_token(dfa, q, vocab)
        assert np.array_equal(inside, want_inside), (pattern, q)
        assert np.array_equal(np.sort(uncertain), want_uncertain), (pattern, q)
        # A token at a time (where it answers), over every first byte and over every third one.
        for nodes in (live, live[::3]):
            walked = token_walk.walk_tokens(dfa, q, nodes, *trie_walk.other_bytes(dfa), vocab)
            if walked is not None:
                tokens_read += 1
                want = (want_inside, want_uncertain) if len(nodes) == len(live) else \
                    trie_walk.walk_trie(pattern, dfa, nodes, nxt[nodes], vocab)
                assert np.array_equal(walked[0], want[0]), (pattern, q, len(nodes))
                assert np.array_equal(np.sort(walked[1]), np.sort(want[1])), (pattern, q, len(nodes))
    assert tokens_read


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


def _exit_pairs_one_by_one(dfa, ids, states, vocab) -> set[tuple[int, int]]:
    """terminal_tokens._exit_pairs the slow way: each token stepped byte by byte from its state."""
    pairs = set()
    for i, q in zip(ids.tolist(), states.tolist()):
        data = vocab.token_bytes[i]
        for j in range(1, len(data)):
            if q < 0:
                break
            if dfa.accepting[q]:
                pairs.add((i, j))
            q = int(dfa.transitions[q, data[j]])
    return pairs


def test_exit_pairs_equal_stepping_each_token(qwen):
    """Exit pairs stepped over the tokens still alive (stopping once none is) equal each token's own walk,
    for terminals whose tokens pass accepting states at several positions (numbers, a string of a's)."""
    vocab = prepare_vocab(qwen)
    rng = np.random.default_rng(2)
    first_node = first_nodes.first_node(vocab)
    checked = 0
    for schema in [{"type": "number"}, {"type": "string", "pattern": "^a*$"}, SCHEMAS[2]]:
        grammar = build_constraint("json_schema", schema, qwen).index.grammar
        for dfa in grammar.terminals:
            for q in range(min(dfa.num_states, 12)):
                ids = np.sort(rng.choice(vocab.size, 3000, replace=False))
                ids = ids[first_node[ids] >= 0]
                states = dfa.transitions[q, [vocab.token_bytes[i][0] for i in ids.tolist()]].astype(np.int64)
                ids, states = ids[states >= 0], states[states >= 0]
                tokens, starts = terminal_tokens._exit_pairs(dfa, ids, states, vocab)
                got = set(zip(tokens.tolist(), starts.tolist()))
                assert len(got) == len(tokens) and got == _exit_pairs_one_by_one(dfa, ids, states, vocab)
                checked += len(got)
    assert checked > 100


def test_exit_tokens_kept_per_set_of_suffixes_equal_selecting_them():
    """Exits.tokens_of, kept per set of suffixes, equals selecting the pairs of those suffixes, whatever
    order a walk found them in and for sets of the same size (a key on anything less than the set fails)."""
    rng = np.random.default_rng(5)
    suffixes = [b",", b",\"", b",{", b"}", b"}}", b"]", b" "]
    tokens = rng.permutation(200)[:60].tolist()
    exits = terminal_tokens.Exits.build(tokens, [suffixes[i] for i in rng.integers(0, len(suffixes), 60)])
    pairs = list(zip(exits.pair_suffix.tolist(), exits.pair_token.tolist()))
    for _ in range(3):  # the second and third rounds read the kept sets
        for taken in ([0, 3], [3, 0], [1, 4], [2], [6, 5, 4, 3, 2, 1, 0], [5, 1]):
            got = exits.tokens_of(taken)
            assert not got.flags.writeable
            assert sorted(got.tolist()) == sorted(t for s, t in pairs if s in taken)


def test_counted_string_classes_cached_equal_fresh(qwen):
    """A counted string's classes, cached by (opening, place in a character, characters still required, room),
    equal those computed afresh for every state of strings with different bounds."""
    from radixlm.core.runtime.constrained.tokens import counted_tokens
    from radixlm.core.runtime.constrained.tokens.counted_string import counted_string_dfa

    vocab = prepare_vocab(qwen)
    dfas = [counted_string_dfa(lo, hi) for lo, hi in [(0, 3), (2, 5), (1, None), (4, None)]]
    states = [(dfa, state) for dfa in dfas for state in range(dfa.num_states - 1)]
    with counted_tokens._lock:
        counted_tokens._cache.clear()
    got = [terminal_tokens.state_tokens("counted", dfa, state, vocab) for dfa, state in states]  # some hits
    for (dfa, state), found in zip(states, got):
        with counted_tokens._lock:
            counted_tokens._cache.clear()
        want = terminal_tokens.state_tokens("counted", dfa, state, vocab)
        assert (found[CLOSING] == want[CLOSING]).all(), (dfa.lo, dfa.hi, state)
        if found[INSIDE] is None:
            assert np.array_equal(found[INSIDE_IDS], want[INSIDE_IDS]), (dfa.lo, dfa.hi, state)
        else:
            assert (found[INSIDE] == want[INSIDE]).all(), (dfa.lo, dfa.hi, state)
    assert sum(dfa.written(state) is not None for dfa, state in states) > 15


def test_state_rows_cut_on_demand_equal_the_dfa(qwen):
    """A small DFA's rows, read at once and cut per state when asked, and a large one's, read per state,
    are each state's accepting flag, live bytes and targets, held in tuples of numbers (which the cyclic
    collector stops tracking: a list stays an object every full collection walks)."""
    grammar = build_constraint("json_schema", SCHEMAS[0], qwen).index.grammar
    checked = 0
    for name, dfa in zip(grammar.terminal_names, grammar.terminals):
        for at_once in (narrow_walk.ROWS_AT_ONCE, 0):
            narrow_walk._state_rows.clear()
            narrow_walk._dfa_rows.clear()
            try:
                narrow_walk.ROWS_AT_ONCE = at_once
                for q in reversed(range(dfa.num_states)):
                    head, targets = narrow_walk.state_row(name, dfa, q)
                    live = np.flatnonzero(dfa.transitions[q] >= 0)
                    assert head == bytes([int(dfa.accepting[q]), len(live) & 255, *live.tolist()]), (name, q)
                    assert list(targets) == dfa.transitions[q, live].tolist(), (name, q)
                    assert all(type(x) is tuple for x in (targets, *narrow_walk._dfa_rows.get(name, ())[::2])), (name, q)
                    checked += 1
            finally:
                narrow_walk.ROWS_AT_ONCE = 1024
    assert checked > 50


def test_futures_name_equal_automata_alike_and_differ_otherwise():
    """Futures are named by the automaton reachable from a state: a literal's tail has the name of the
    shorter literal it spells, whatever the terminal; another tail, or a longer future, has another."""
    from radixlm.core.runtime.constrained.automata.regex_dfa import literal_dfa, regex_to_dfa

    terminal_tokens._futures.clear()
    abc, xabc, abd = literal_dfa(b"abc"), literal_dfa(b"xabc"), literal_dfa(b"abd")
    name = terminal_tokens._future
    assert name("t:abc", abc, 0) == name("t:xabc", xabc, 1) != name("t:abd", abd, 0)
    assert name("t:abc", abc, 1) != name("t:abd", abd, 1) and name("t:abc", abc, 3) == name("t:abd", abd, 3)
    body, other = regex_to_dfa('[a-z]*"'), regex_to_dfa('[a-y]*"')  # loops: many moves to a few states
    assert name("t:body", body, 0, 1) is None  # over `most` states and not named before
    assert name("t:body", body, 0) != name("t:other", other, 0) and name("t:body", body, 0) is not None
    assert name("t:body", body, 0, 1) == name("t:body", body, 0)  # a known name is returned whatever `most`


def test_literal_states_read_as_chains_equal_their_tables(monkeypatch):
    """A literal's states: the rest literal_rest gives from its LiteralDFA's text equals the one read off the
    same table as a plain ByteDFA, and a suffix tree's classes from each state read along that rest equal
    the general walk of the tree against the table's moves."""
    from radixlm.core.runtime.constrained.automata.regex_dfa import ByteDFA, literal_dfa
    from radixlm.core.runtime.constrained.tokens import token_classes
    from radixlm.core.runtime.constrained.tokens.literal_tokens import literal_rest

    tree = token_classes.SuffixTree(sorted({b'"', b'":', b'":"x', b'a', b'ab', b'abc"', b'b', "é\"".encode(), b'x"}'}))
    nodes = range(len(tree.nodes[0]))
    for text in ['"ab"', 'abc"', "é\"", "", ":", '"x"}']:
        chain = literal_dfa(text.encode())
        table = ByteDFA(transitions=chain.transitions, accepting=chain.accepting)
        states = range(chain.num_states)
        assert [literal_rest(f"lit:{text}", chain, q) for q in states] == \
            [literal_rest(f"table:{text}", table, q) for q in states]
        fast = [tree.classes(n, f"lit:{text}", chain, q) for n in nodes for q in states]
        with monkeypatch.context() as m:
            m.setattr(token_classes, "literal_rest", lambda *args: None)  # the general walk
            walked = [tree.classes(n, f"walk:{text}", table, q) for n in nodes for q in states]
        assert [(sorted(a), sorted(b)) for a, b in fast] == [(sorted(a), sorted(b)) for a, b in walked], text


def test_wide_states_bits_patched_from_recent_ones_equal_a_whole_walk(qwen, monkeypatch):
    """A wide state's inside bits, taken from a recent wide state's with the differing first-byte subtrees
    cleared and set, equal a walk of the whole vocabulary from the state (key terminals that exclude listed
    names against a plain string's body and each other)."""
    vocab = prepare_vocab(qwen)
    first = vocab.trie.byte[1].astype(np.int64)
    patched = []
    inside_bits = terminal_tokens._inside_bits
    monkeypatch.setattr(terminal_tokens, "_inside_bits",
                        lambda have, keys, v: patched.append(len(terminal_tokens._bases)) or inside_bits(have, keys, v))
    monkeypatch.setattr(terminal_tokens, "_patched", lambda *args: None)  # the general path (body_states.py aside)
    with terminal_tokens._lock:
        terminal_tokens._cache.clear()
    # Plain string bodies first, then keys that exclude names (differing subtrees: the names' letters),
    # then keys that cannot start with `a` (a subtree the bases have and these states lack).
    terminals = []
    for schema in [{"type": "object", "properties": {"foo": {}, "fob": {}, "bar": {}, "zzz": {}},
                    "additionalProperties": {"type": "string"}},
                   {"type": "object", "propertyNames": {"pattern": "^[^a]"}}]:
        grammar = build_constraint("json_schema", schema, qwen).index.grammar
        terminals += zip(grammar.terminal_names, grammar.terminals)
    for name, dfa in terminals:
        for q in range(min(dfa.num_states, 12)):
            nxt = dfa.transitions[q, first]
            live = np.flatnonzero(nxt >= 0)
            if len(live) <= narrow_walk.NARROW_NODES:
                continue
            got = np.unpackbits(terminal_tokens._classify(name, dfa, q, vocab)[INSIDE], count=vocab.size,
                                bitorder="little")
            whole, _ = trie_walk.walk_trie(name, dfa, live, nxt[live], vocab)
            assert (got.astype(bool) == whole).all(), (name, q)
    assert len(patched) > 5 and max(patched) > 0


def _assert_reads_as_a_whole_walk(found, name: str, dfa, q: int, vocab, first: np.ndarray) -> None:
    """The classes found for state q equal those of a walk of the whole vocabulary from it."""
    nxt = dfa.transitions[q, first]
    live = np.flatnonzero(nxt >= 0)
    inside, uncertain = trie_walk.walk_trie(name, dfa, live, nxt[live], vocab)
    tokens, starts = terminal_tokens._exit_pairs(dfa, uncertain, terminal_tokens._after_first(
        nxt, live, vocab, uncertain), vocab)
    got = np.unpackbits(found[INSIDE], count=vocab.size, bitorder="little").astype(bool)
    assert (got == inside).all(), (name, q)
    pairs = {(t, vocab.token_bytes[t][j:]) for t, j in zip(tokens.tolist(), starts.tolist())}
    assert _exit_pairs_of(found[EXITS]) == pairs, (name, q)


def _exit_pairs_of(exits) -> set[tuple[int, bytes]]:
    if exits is None:
        return set()
    return {(t, exits.tree.suffixes[s]) for s, t in zip(exits.pair_suffix.tolist(), exits.pair_token.tolist())}


def test_literal_classes_equal_the_general_walk(qwen):
    """A literal's states (keys, `null`, punctuation; the tails `":`, `,` that many tokens cross) classified
    from the sorted vocabulary equal the general walk's classes: the same inside bits, the same exit pairs.
    States that are not the rest of a chain (a string body, a number, a literal that may end early) are left
    to the general walk."""
    from radixlm.core.runtime.constrained.automata.grammar_compiler import terminal_dfa
    from radixlm.core.runtime.constrained.tokens.literal_tokens import literal_rest

    vocab = prepare_vocab(qwen)
    checked = 0
    for regex in ['"name":', '"customer_id":', "null", ",", "true", '"\\\\u00e9":', '"é":', "ab(cd)?"]:
        dfa = terminal_dfa(regex, 1000)
        key = f"test:{regex}"
        for q in range(dfa.num_states):
            rest = literal_rest(key, dfa, q)
            if dfa.accepting[q] or rest is None:  # ends, or `ab(cd)?` before its accepting `ab`
                assert dfa.accepting[q] or regex == "ab(cd)?", (regex, q)
                continue
            fast = terminal_tokens._literals([rest], vocab)[0]
            slow = terminal_tokens._classify(key, dfa, q, vocab)
            assert np.array_equal(terminal_tokens._packed(fast[INSIDE_IDS], vocab.size), slow[INSIDE]), (regex, q)
            assert _exit_pairs_of(fast[EXITS]) == _exit_pairs_of(slow[EXITS]), (regex, q)
            checked += 1
    assert checked > 20
    for schema in [{"type": "string"}, {"type": "number"}]:
        grammar = build_constraint("json_schema", schema, qwen).index.grammar
        for name, dfa in zip(grammar.terminal_names, grammar.terminals):
            if dfa.num_states > 3:
                assert literal_rest(name, dfa, 0) is None, name
    ab = terminal_dfa("ab(cd)?", 1000)
    assert literal_rest("test:ab(cd)?", ab, 0) is None  # `ab` accepts before the chain's end
    assert literal_rest("test:ab(cd)?", ab, int(ab.transitions[int(ab.transitions[0, ord("a")]), ord("b")])) is None


def test_an_enum_of_hundreds_of_strings_masks_like_reading_each_token(qwen, monkeypatch):
    """A configuration of hundreds of literal items sharing prefixes (one a prefix of another, escaped, not
    ASCII), classified in one batch (literal_tokens.literal_classes): its mask, at the enum's start and part
    way into its strings, equals reading every token of the vocabulary byte by byte from the configuration."""
    from radixlm.core.runtime.constrained.tokens import literal_tokens

    names = ["GPL", "LGPL", "AGPL", "Apache", "BSD", "MIT", "CC-BY", "CC-BY-SA", "MPL", "EPL", "é-lib", 'q"x']
    versions = ["", "-1.0", "-2.0", "-2.0-only", "-2.0-or-later", "-3.0", "-3.0-only", "-3.0-or-later", "-2.1",
                "-1.1", "-4.0", "-4.0-international", "+", "-1.0+", "-clause", "-2-Clause", "-3-Clause", "-x"]
    enum = [n + v for n in names for v in versions] + ["a", "ab", "abc", "abcd", "The", "Then", "Th"]
    batches: list[int] = []
    classes = literal_tokens.literal_classes
    monkeypatch.setattr(terminal_tokens, "literal_classes",
                        lambda rests, vocab: batches.append(len(rests)) or classes(rests, vocab))
    index = build_constraint("json_schema", {"type": "array", "items": {"enum": enum}}, qwen).index
    token_bytes = prepare_vocab(qwen).token_bytes
    state, checked = index.start, 0
    for data in [b"", b"[", b'"', b"GPL-", b"2.0-", b"o"]:
        for b in data:
            state = index.byte_successors(state)[b]
        allowed = {t for t, x in enumerate(token_bytes) if x and _spells(index, state, x)}
        assert set(index.allowed_tokens(state).tolist()) == allowed, data
        checked += len(allowed)
    assert max(batches) >= len(enum) and checked > 50


def test_states_apart_from_the_body_equal_a_whole_walk(qwen):
    """A key terminal's states past letters of the names it excludes, classified as its string body less the
    tokens that die where the two part (body_states.py), equal a walk of the whole vocabulary from the state:
    the same inside bits, the same exit pairs. Names share prefixes, one is a prefix of another, one is
    empty, one escaped, one not ASCII; the patterned key's states past `x-` are a body of their own."""
    from radixlm.core.runtime.constrained.tokens.body_states import body_of

    vocab = prepare_vocab(qwen)
    first = vocab.trie.byte[1].astype(np.int64)
    names = ["foo", "fob", "bar", "ab", "abc", "", "x\"y", "é", "a\\b", "zz"]
    schema = {"type": "object", "properties": {n: {} for n in names},
              "patternProperties": {"^x-": {"type": "integer"}}, "additionalProperties": {"type": "string"}}
    grammar = build_constraint("json_schema", schema, qwen).index.grammar
    patched = 0
    for name, dfa in zip(grammar.terminal_names, grammar.terminals):
        if not name.startswith("key:"):
            continue
        for q in range(dfa.num_states):
            found = terminal_tokens._patched(name, dfa, q, vocab)
            if found is None:
                continue
            _assert_reads_as_a_whole_walk(found, name, dfa, q, vocab, first)
            patched += 1
        assert body_of(name, dfa, 0) is None  # the opening quote leads to no body loop
    assert patched > 10


def test_states_apart_from_the_body_refused_where_exits_or_reads_differ(qwen):
    """Where the two states part on a byte after which the state accepts and the body does not (the state's
    exits there differ), or the state reads a byte the body dies on, the state is left to the general walk:
    hand-made automata, a body (1) of letters, spaces and dots closed by `"` (2), and a state 0 like it but
    for its dot, which leads to 3: the body's row, accepting; or the body's row and a newline."""
    from radixlm.core.runtime.constrained.tokens.body_states import paths_apart
    from radixlm.core.runtime.constrained.automata.regex_dfa import ByteDFA

    vocab = prepare_vocab(qwen)
    body = [*range(ord("a"), ord("z") + 1), ord(" "), ord(".")]
    for variant in ("accepting", "newline"):
        trans = np.full((4, 256), -1, dtype=np.int32)
        for q in (0, 1, 3):
            trans[q, body] = 1
            trans[q, ord('"')] = 2
        trans[0, ord(".")] = 3
        if variant == "newline":
            trans[3, ord("\n")] = 1  # `.\n` goes on from state 0, dies from the body
        dfa = ByteDFA(trans, np.array([False, False, True, variant == "accepting"]))
        assert paths_apart(f"test:{variant}", dfa, 0, 1, vocab) is None, variant
        assert terminal_tokens._patched(f"test:{variant}", dfa, 0, vocab) is None, variant


def test_states_read_like_another_equal_a_whole_walk(qwen):
    """A wide state read as another state of its terminal (a string body) but for the tokens containing the
    bytes on which the two may stop agreeing, which are read again from it (terminal_tokens._reread), equals a
    walk of the whole vocabulary from the state: pattern keys before and after their pattern matches,
    anchored and not, an escape, digits, a non-ASCII letter; and a hand-made automaton whose state accepts
    where the other does not, both alive. The bytes apart of a pattern key's state before its match and its
    matched state are the closing quote alone."""
    from radixlm.core.runtime.constrained.tokens.body_states import bytes_apart
    from radixlm.core.runtime.constrained.automata.regex_dfa import ByteDFA

    vocab = prepare_vocab(qwen)
    first = vocab.trie.byte[1].astype(np.int64)
    terminals = []
    for pattern in ["f.*o", "^x-", "[0-9]", "é\\\\n", "b.r"]:
        grammar = build_constraint("json_schema", {"type": "object", "patternProperties": {pattern: {}}},
                                   qwen).index.grammar
        terminals += zip(grammar.terminal_names, grammar.terminals)
    # By hand: a loop (1) over letters, `,` and `~`, closed by `"` (3); state 0 reads like it but for `~`,
    # after which it accepts (2, otherwise the loop): both alive there, the state accepting and the loop not,
    # so tokens with `~` are read again, and those inside from 0 pass an accepting state before their end.
    trans = np.full((4, 256), -1, dtype=np.int32)
    trans[:3, [*range(ord("a"), ord("z") + 1), ord(","), ord("~")]] = 1
    trans[:3, ord('"')] = 3
    trans[0, ord("~")] = 2
    tilde = ByteDFA(trans, np.array([False, False, True, True]))
    terminal_tokens.state_tokens("test:tilde", tilde, 1, vocab)  # the loop's classes, known
    terminals.append(("test:tilde", tilde))
    reread = 0
    for name, dfa in terminals:
        for q in range(min(dfa.num_states, 40)):
            found = terminal_tokens._reread(name, dfa, q, vocab)
            if found is None:
                continue
            _assert_reads_as_a_whole_walk(found, name, dfa, q, vocab, first)
            reread += 1
    assert reread > 5 and terminal_tokens._reread("test:tilde", tilde, 0, vocab) is not None
    key = next((n, d) for n, d in terminals if "[\\U00000066]" in n and n.startswith("key:"))
    matched = key[1].walk(b'"fo')
    assert np.flatnonzero(bytes_apart(key[1], 1, matched)).tolist() == [ord('"')]
    assert np.flatnonzero(bytes_apart(tilde, 0, 1)).tolist() == [ord("~")]


def _exit_walks_ready(index, state: int) -> bool:
    """Whether every exit walk of `state`'s items is in `index`'s cache."""
    names, terminals = index.grammar.terminal_names, index.grammar.terminals
    for t, q, k in index._items[state]:
        classes = terminal_tokens.state_tokens(names[t], terminals[t], q, index.vocab)
        if any(e is not None and (e, k) not in index._exits for e in (classes[EXITS], classes[AFTER_QUOTE])):
            return False
    return True


def test_masks_warmed_at_compile_equal_cold_ones(qwen):
    """An index warmed with the compile (GrammarBudget.warm_seconds) has the exit walks of the configuration
    after `{"`, of a key's value and of a key two bytes before its end (the literal and the key terminal
    excluding that name, moved along it) ready before any mask, one without a warm-up budget does not; the
    start's kept bits equal its pieces joined; both indexes give equal masks along random walks."""
    vocab = prepare_vocab(qwen)
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "additionalProperties": {"type": "boolean"}}
    grammar = grammar_index_cache.grammar_of("json_schema", schema)
    warm = GrammarIndex(compile_grammar(grammar, GrammarBudget(warm_seconds=10.0)), vocab)
    cold = GrammarIndex(compile_grammar(grammar, GrammarBudget(warm_seconds=0.0)), vocab)
    # Two bytes from the start; where a value resumes; a key two bytes before its end (its `":`), where the
    # additional key terminal is past the name's letters.
    for prefix, items in ((b'{"', 0), (b'{"name":', 0), (b'{"name', 2), (b'{"name"', 1)):
        ready = []
        for index in (warm, cold):
            state = index.start
            for b in prefix:
                state = index.byte_successors(state)[b]
            assert len(index._items[state]) >= items
            ready.append(_exit_walks_ready(index, state))
        assert ready == [True, False], prefix
    kept = warm._walk(warm.start, 4 * -(-vocab.size // 32))  # the start's bits, kept with the compile
    warm._start_bits = None
    assert np.array_equal(kept, warm._walk(warm.start, len(kept)))
    rng = np.random.default_rng(2)
    compared = 0
    for _ in range(8):
        states = [warm.start, cold.start]
        for token in random_walk(build_constraint("json_schema", schema, qwen), rng, max_tokens=30):
            assert np.array_equal(warm.mask(states[0], vocab.size).numpy(), cold.mask(states[1], vocab.size).numpy())
            states = [index.next_state(s, token) for index, s in zip((warm, cold), states)]
            compared += 1
    assert compared > 50


def test_warm_seconds_option_is_checked():
    """The engine option behind GrammarBudget.warm_seconds: 0 turns the warm-up off, a negative time is refused."""
    assert EngineOptions.from_kwargs({"grammar_warm_seconds": 0}).grammar_warm_seconds == 0.0
    with pytest.raises(InvalidRequestError, match="grammar_warm_seconds"):
        EngineOptions.from_kwargs({"grammar_warm_seconds": -0.001})


def test_set_bits_equals_packing_ids():
    """A few ids (set one by one) and many (one numpy call), repeats and neighbours in one byte included."""
    rng = np.random.default_rng(3)
    for n in (0, 1, 5, vocab_mod.FEW_IDS, vocab_mod.FEW_IDS + 1, 500):
        ids = np.concatenate([rng.integers(0, 1000, n), rng.integers(0, 1000, n // 3), [7, 6][: min(n, 2)]]).astype(np.int64)
        packed = np.zeros(125, dtype=np.uint8)
        vocab_mod.set_bits(packed, ids)
        want = np.zeros(1000, dtype=bool)
        want[ids] = True
        assert np.array_equal(packed, np.packbits(want, bitorder="little")), n


def test_token_walk_left_to_the_trie_past_its_matrix_budget(monkeypatch):
    """A vocabulary whose padded token bytes would pass MATRIX_BYTES has no TokenBytes: the walk a token at a
    time answers None (the trie walk runs), and within the budget it answers."""
    dfa = regex_to_dfa(r'"[^"]*"')
    for budget, answered in ((1, False), (1 << 20, True)):
        monkeypatch.setattr(token_walk, "MATRIX_BYTES", budget)
        vocab = TokenVocab([b"a", b'b"', b"\xc3\xa9c"], frozenset(), (), f"tiny-{budget}")
        first = vocab.trie.byte[1].astype(np.int64)
        nxt = dfa.transitions[1, first]
        walked = token_walk.walk_tokens(dfa, 1, np.flatnonzero(nxt >= 0), *trie_walk.other_bytes(dfa), vocab)
        assert (walked is not None) == answered
        if answered:
            assert walked[0].tolist() == [True, True, True] and walked[1].tolist() == []
