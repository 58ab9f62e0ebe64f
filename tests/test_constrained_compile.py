"""The compile path's per-process parts: the tokenizer's share built once (grammar_index_cache.prepare_vocab,
the vocabulary read as JSON string content, checked token by token against Python's own json decoder),
and compiles with the cyclic garbage collector paused (gc_paused) across threads."""

from __future__ import annotations

import codecs
import gc
import json
import subprocess
import sys
import threading

import numpy as np
import pytest

from radixlm.core.runtime.constrained.tokens import terminal_tokens
from radixlm.core.runtime.constrained.tokens.counted_string import string_tokens
from radixlm.core.runtime.constrained.automata.grammar_compiler import compile_grammar
from radixlm.core.runtime.constrained.tokens.masks import unpack_bitmask
from radixlm.core.runtime.constrained.grammar_index_cache import (gc_paused, grammar_of, prepare_common_terminals,
                                                          prepare_vocab)
from radixlm.core.runtime.constrained.pda import GrammarIndex
from radixlm.testing.constrained import qwen2_tokenizer


@pytest.fixture(scope="module")
def vocab():
    return prepare_vocab(qwen2_tokenizer())


def _oracle(data: bytes) -> tuple[str, int]:
    """What a token's bytes do inside a JSON string, from Python's json: ('inside', characters) when they
    are whole characters of a string body, ('closing', characters before the quote) when they end the
    string (whatever follows), ('partial', characters + 1) when they end inside a UTF-8 character, else
    ('bad', 0)."""
    for cut in range(len(data)):
        if data[cut:cut + 1] == b'"' and _body(data[:cut]) is not None:
            return "closing", _body(data[:cut])
    body = _body(data)
    if body is not None:
        return "inside", body
    for end in range(len(data) - 1, max(len(data) - 4, -1), -1):  # a UTF-8 character cut short
        rest = data[end:]
        if _body(data[:end]) is not None and b'"' not in rest and b"\\" not in rest:
            try:
                if codecs.getincrementaldecoder("utf-8")().decode(rest, final=False) == "":
                    return "partial", _body(data[:end]) + 1
            except UnicodeDecodeError:
                pass
    return "bad", 0


def _body(data: bytes) -> int | None:
    """The characters of `data` read as a whole JSON string body (what jsonschema counts), else None."""
    try:
        return len(json.loads(b'"' + data + b'"'))
    except (ValueError, UnicodeDecodeError):
        return None


def test_prepare_vocab_prepares_a_vocabulary_once(vocab, monkeypatch):
    """A front end and its scheduler in one process both prepare at start: the second call finds the
    vocabulary prepared and compiles nothing (the common terminals' schema is compiled once)."""
    from radixlm.core.runtime.constrained import grammar_index_cache

    compiles = []

    def counted(*args, **kwargs):
        compiles.append(args)
        return compile_grammar(*args, **kwargs)

    monkeypatch.setattr(grammar_index_cache, "compile_grammar", counted)
    assert prepare_vocab(qwen2_tokenizer()) is vocab
    assert compiles == []


def test_prepare_vocab_reads_the_vocabulary_once_as_json_python_does(vocab):
    reads = string_tokens(vocab)
    assert string_tokens(vocab) is reads  # built by prepare_vocab, cached per process
    rng = np.random.default_rng(0)
    quoted = [i for i, b in enumerate(vocab.token_bytes) if b'"' in b or b"\\" in b]
    sample = sorted(set(rng.choice(vocab.size, 3000, replace=False).tolist()) | set(quoted[:1500]))
    top = reads.max_count
    inside = np.unpackbits(reads.allowed_inside(None), bitorder="little")[:vocab.size].astype(bool)
    closing = np.unpackbits(reads.closing_between(0, None), bitorder="little")[:vocab.size].astype(bool)
    checked = 0
    for t in sample:
        data = vocab.token_bytes[t]
        if not data:
            assert not inside[t] and not closing[t]
            continue
        kind, count = _oracle(data)
        if kind == "bad" and b"\\" in data:
            continue  # an escape cut short (this oracle does not tell it from a bad one)
        assert inside[t] == (kind in ("inside", "partial")), (data, kind)
        assert closing[t] == (kind == "closing"), (data, kind)
        if kind in ("inside", "partial") and count <= top:
            room = np.unpackbits(reads.allowed_inside(count), bitorder="little")[t]
            less = np.unpackbits(reads.allowed_inside(count - 1), bitorder="little")[t] if count else 0
            assert room and not less, (data, kind, count)
        checked += 1
    assert checked > 3000


# A schema no other test uses: its own terminals are its literal keys and the key terminal excluding them
# (all named with "zq_"); its integers, numbers, booleans, null and punctuation are every schema's.
_FRESH = {"type": "object", "properties": {"zq_count": {"type": "integer"}, "zq_ratio": {"type": "number"},
                                           "zq_flags": {"type": "array", "items": {"type": "boolean"}}},
          "additionalProperties": {"type": "null"}}
_INSTANCE = {"zq_count": -12, "zq_ratio": 0.035, "zq_flags": [True, False], "other": None, "zq_x": None}


def _clear_token_classes() -> None:
    """The process's token classes forgotten, as in a process that has built none."""
    with terminal_tokens._lock:
        for cache in (terminal_tokens._cache, terminal_tokens._exits_cache, terminal_tokens._subtrees,
                      terminal_tokens._futures):
            cache.clear()
        terminal_tokens._subtree_ids = 0


def _walk_fresh_schema(vocab, monkeypatch) -> tuple[list[np.ndarray], list[str]]:
    """The masks along _INSTANCE's tokens in a new index of _FRESH (each token checked allowed), and the
    terminals whose token classes were built on the way."""
    built = []
    classify = terminal_tokens._classify
    monkeypatch.setattr(terminal_tokens, "_classify",
                        lambda key, dfa, state, v: built.append(key) or classify(key, dfa, state, v))
    index = GrammarIndex(compile_grammar(grammar_of("json_schema", _FRESH)), vocab)
    state, masks = index.start, []
    for token in qwen2_tokenizer().encode(json.dumps(_INSTANCE, separators=(",", ":"))):
        masks.append(index.mask(state, vocab.size).numpy())
        assert masks[-1][token]
        state = index.next_state(state, token)
    assert index.is_accepting(state)
    monkeypatch.undo()
    return masks, built


def test_start_up_preparation_serves_a_fresh_schemas_common_terminals(vocab, monkeypatch):
    _clear_token_classes()
    cold_masks, cold_built = _walk_fresh_schema(vocab, monkeypatch)
    assert any(k.startswith("re:-?(?:0|[1-9][0-9]*)") for k in cold_built)  # numbers built at first use
    assert any(k == "re:true|false" for k in cold_built)
    _clear_token_classes()
    prepare_common_terminals(vocab)
    masks, built = _walk_fresh_schema(vocab, monkeypatch)
    assert built and all("zq_" in k for k in built)  # only the schema's own key terminals are new
    assert len(masks) == len(cold_masks) and all((a == b).all() for a, b in zip(masks, cold_masks))


def test_gc_is_paused_while_any_compile_runs_and_restored_after():
    assert gc.isenabled()
    started, release = threading.Barrier(3), threading.Event()
    seen = []

    def compile_() -> None:
        with gc_paused():
            started.wait()
            release.wait()
            seen.append(gc.isenabled())

    threads = [threading.Thread(target=compile_) for _ in range(2)]
    for th in threads:
        th.start()
    started.wait()
    assert not gc.isenabled()
    release.set()
    for th in threads:
        th.join()
    assert seen == [False, False] and gc.isenabled()
    gc.disable()  # a process that turned it off itself keeps it off
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


_NO_CYCLES = """
import gc, json, sys
from radixlm.core.runtime.constrained.automata.grammar_compiler import compile_grammar
from radixlm.core.runtime.constrained.grammar_index_cache import grammar_of
schemas = json.loads(sys.argv[1])
for schema in schemas:  # first compiles import modules lazily (classes hold cycles of their own)
    compile_grammar(grammar_of("json_schema", schema))
gc.collect()
gc.disable()
gc.set_debug(gc.DEBUG_SAVEALL)
for schema in schemas:
    compile_grammar(grammar_of("json_schema", schema))
gc.collect()
print(json.dumps([type(o).__qualname__ for o in gc.garbage]))
"""


def test_compiles_leave_no_cycles():
    """A compile's objects are freed by reference counting when it returns: compiles run with the collector
    paused, and cycles left behind (recursive closures holding the converter, its rules, SchemaRefs) were
    collected inside the next masks (benchmarks/results/2026-12-02-grammar-masks.md). It runs in a
    process of its own: in the test process, other tests' servers and event loops leave garbage of their
    own at any moment."""
    schemas = [
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}},  # any order
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},  # in order
         "required": ["a", "b"], "maxProperties": 3},
        {"type": "object", "properties": {"ab": {}, "abc": {}}, "propertyNames": {"not": {"const": "ab"}}},
    ]
    done = subprocess.run([sys.executable, "-c", _NO_CYCLES, json.dumps(schemas)], capture_output=True,
                          text=True, timeout=120, check=True)
    assert json.loads(done.stdout) == []


def _random_expr(rng: np.random.Generator, leaves: list, depth: int):
    """A random grammar expression over `leaves`, with the regex it stands for."""
    from radixlm.core.runtime.constrained.automata.grammar import Alt, Repeat, Seq

    kind = rng.integers(4) if depth else 0
    if kind == 0:
        leaf, regex = leaves[rng.integers(len(leaves))]
        return leaf, regex
    parts = [_random_expr(rng, leaves, depth - 1) for _ in range(int(rng.integers(1, 4)))]
    if kind == 1:
        return Seq(tuple(p for p, _ in parts)), "".join(f"(?:{r})" for _, r in parts)
    if kind == 2:
        return Alt(tuple(p for p, _ in parts)), "|".join(f"(?:{r})" for _, r in parts)
    lo = int(rng.integers(3))
    hi = None if rng.integers(2) else lo + int(rng.integers(3))
    return Repeat(parts[0][0], lo, hi), f"(?:{parts[0][1]}){{{lo},{'' if hi is None else hi}}}"


def test_rules_sharing_a_shape_keep_their_own_languages(vocab):
    """Rule automata are cached by shape (the expression with its distinct symbols numbered): random rules
    over a few terminals and rules, many of one shape with other symbols (or one symbol in several places),
    accept exactly what Python's re accepts of the same expression, on every string up to 5 bytes."""
    import itertools
    import re

    from radixlm.core.runtime.constrained.automata.grammar import Grammar, Ref, lit, seq

    strings = ["".join(p) for n in range(6) for p in itertools.product("abc", repeat=n)]
    leaves = [(lit("a"), "a"), (lit("b"), "b"), (lit("ab"), "ab"), (Ref("c"), "c"), (Ref("bc"), "bc")]
    rng = np.random.default_rng(17)
    for _ in range(40):
        expr, regex = _random_expr(rng, leaves, 3)
        grammar = Grammar({"start": expr, "c": lit("c"), "bc": seq(lit("b"), lit("c"))}, "start")
        try:
            compiled = compile_grammar(grammar)
        except ValueError:  # no string at all (re agrees: checked below)
            assert not any(re.fullmatch(regex, s) for s in strings), regex
            continue
        index = GrammarIndex(compiled, vocab)
        for s in strings:
            state = index.start
            for b in s.encode():
                state = index.byte_successors(state)[b] if state >= 0 else -1
            assert (state >= 0 and index.is_accepting(state)) == (re.fullmatch(regex, s) is not None), (regex, s)



def test_pruning_keeps_exactly_the_edges_that_can_finish():
    """compile_grammar drops edges on empty terminals and on rules that cannot finish, and the states that
    then cannot finish; rules it need not touch stay whole. Checked against a plain fixpoint over the
    unpruned automata (every state and rule recomputed until nothing changes), on grammars with rules that
    recurse without an exit, an empty terminal, and rules that reach those only on some branches."""
    from radixlm.core.runtime.constrained.automata import grammar_compiler as gc_mod
    from radixlm.core.runtime.constrained.automata.grammar import Grammar, Ref, Terminal, alt, lit, opt, seq

    empty = Terminal(regex="[^\\s\\S]")  # no string
    rules = {"start": alt(seq(lit("["), Ref("loop"), lit("]")), seq(lit("{"), opt(Ref("ok")), lit("}")),
                          seq(Ref("mixed"), lit("."))),
             "loop": seq(lit("a"), Ref("loop")),  # never finishes
             "deep": alt(Ref("loop"), seq(empty, lit("x"))),  # only through things that never finish
             "mixed": alt(seq(lit("m"), Ref("deep")), seq(lit("n"), empty), seq(lit("o"), opt(Ref("ok")))),
             "ok": alt(lit("k"), seq(lit("k"), Ref("ok")))}
    builder = gc_mod._Builder(Grammar(rules, "start"), gc_mod.DEFAULT_BUDGET, gc_mod.Deadline(gc_mod.DEFAULT_BUDGET))
    ids = {name: i for i, name in enumerate(rules)}
    built = [builder.rule(name, expr, ids) for name, expr in rules.items()]
    before = [([list(row) for row in r.edges], list(r.accepting)) for r in built]
    terminals = builder.terminal_dfas
    assert any(t is None for t in terminals)

    live = [[False] * len(r.edges) for r in built]  # the plain fixpoint
    changed = True
    while changed:
        changed = False
        for r, rule in enumerate(built):
            for s, row in enumerate(rule.edges):
                usable = [t for sym, t in row if (live[sym >> 1][0] if sym % 2 else terminals[sym >> 1] is not None)]
                now = rule.accepting[s] or any(live[r][t] for t in usable)
                if now and not live[r][s]:
                    live[r][s] = changed = True
    gc_mod._prune(built, terminals, builder.finishing, builder.symbols)
    for r, (rule, (edges, accepting)) in enumerate(zip(built, before)):
        def ok(sym: int, t: int) -> bool:
            return live[r][t] and (live[sym >> 1][0] if sym % 2 else terminals[sym >> 1] is not None)
        assert [list(row) for row in rule.edges] == [[(sym, t) for sym, t in row if ok(sym, t)] if live[r][s] else []
                                                     for s, row in enumerate(edges)], rule.name
        assert list(rule.accepting) == [a and live[r][s] for s, a in enumerate(accepting)], rule.name
    assert [list(row) for row in built[ids["ok"]].edges] == before[ids["ok"]][0]  # nothing of it to drop
    assert not built[ids["loop"]].edges[0] and not built[ids["deep"]].edges[0]
    assert [list(row) for row in built[ids["start"]].edges] != before[ids["start"]][0]  # the "[" branch went


def test_the_start_configurations_classes_are_built_with_the_compile(monkeypatch):
    """The start configuration's token classes and exit walks are built when the index is (with the compile),
    so a request's first mask classifies no terminal state and walks no exits (the tokens `{"zqxwv_...` cross
    from the brace into keys no other test uses)."""
    from radixlm.core.runtime.constrained import build_constraint

    classified = []
    classify = terminal_tokens._classify
    monkeypatch.setattr(terminal_tokens, "_classify", lambda *a: classified.append(a[2]) or classify(*a))
    schema = {"type": "object", "properties": {"zqxwv_start": {"type": "integer"}, "zqxwv_other": {"type": "string"}}}
    tokenizer = qwen2_tokenizer()
    constraint = build_constraint("json_schema", schema, tokenizer)
    walks = len(constraint.index._exits)
    assert walks, "the compile walked no exits of the start configuration"
    del classified[:]
    allowed = unpack_bitmask(constraint.allowed_token_mask(len(tokenizer), packed=True), len(tokenizer))
    assert classified == [] and len(constraint.index._exits) == walks
    assert allowed[tokenizer.encode('{"', add_special_tokens=False)[0]]


@pytest.mark.parametrize("schema", [
    {"type": "array", "contains": {"type": "integer"}, "minContains": 2, "maxItems": 4},  # json_arrays' rest
    {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True},  # json_unique's rest
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
     "required": ["a"], "additionalProperties": {"type": "boolean"}},
    {"oneOf": [{"type": "string"}, {"type": "array", "items": {"oneOf": [{"type": "integer"}, {"minimum": 2}]}}],
     "not": {"enum": ["x"]}},  # branches whose conversion is attempted and refused (_attempt)
])
def test_a_conversion_leaves_no_cyclic_garbage(schema, vocab):
    """What a compile makes is freed by reference counting when dropped: garbage in cycles waits for a
    full collection, whose pause grows with it (the corpus left ~1M such objects: ~0.7 s collections)."""
    grammar_of("json_schema", schema)  # whatever is built once per process (imports, shared caches)
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        compiled = compile_grammar(grammar_of("json_schema", schema))
        GrammarIndex(compiled, vocab)
        del compiled
        assert gc.collect() == 0
    finally:
        if was:
            gc.enable()


def test_a_live_index_keeps_its_tables_out_of_the_collectors_tracking(vocab):
    """The tables a live index reads (its rules' moves and accepting flags, its terminals' accepting flags,
    a counted string's scalar rows) are tuples of numbers, which the cyclic collector stops tracking in its
    first passes (young collections, while they are new): a full collection while the index lives (inside some mask) does not walk them. Lists would
    stay tracked: a large grammar's thousands of rule states, each walked by every full collection."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 40000},
                                               "b": {"type": "array", "items": {"enum": ["x", "y"]}}},
              "patternProperties": {"^z": {"type": "integer"}}}
    index = GrammarIndex(compile_grammar(grammar_of("json_schema", schema)), vocab)
    for _ in range(4):  # a pass untracks the tuples whose items it found untracked: one level of nesting each
        gc.collect()
    rules = index.grammar.rules
    assert len(rules) > 3 and sum(len(r.edges) for r in rules) > 10
    tables = [index._rule_edges, index._rule_acc, index._acc, *(r.edges for r in rules), *(r.accepting for r in rules)]
    counted = [t for t in index._trans if hasattr(t, "_slot_rows")]
    assert counted  # maxLength 40000: a CountedTable, not a stored table
    tables += [x for t in counted for x in (t._slot_rows, t._ends_rows)]
    assert [gc.is_tracked(x) for x in tables] == [False] * len(tables)


_STOPPED_PREPARATION = """
import threading
from radixlm.core.runtime.constrained.grammar_index_cache import prepare_in_background
from radixlm.testing.constrained import qwen2_tokenizer
called = []
stop = prepare_in_background(qwen2_tokenizer(), None, then=lambda: called.append(1))
stop.set()
worker, = [t for t in threading.enumerate() if t.name == "radixlm-prepare-vocab"]
worker.join(60)
print(worker.daemon, worker.is_alive(), called)
"""


def test_a_stopped_background_preparation_ends_without_its_callback_and_is_waited_for_at_exit():
    """An engine's close stops the preparation it started (in a fresh process, where Qwen2's takes
    seconds): the thread ends after the part in hand without calling `then`. It is no daemon: a daemon
    thread inside numpy's C++ code when the interpreter finalized aborted short scripts at exit."""
    done = subprocess.run([sys.executable, "-c", _STOPPED_PREPARATION], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False", "[]"]
