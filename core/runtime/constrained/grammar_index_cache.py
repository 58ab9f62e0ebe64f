"""The compiled grammars of recent constraints, one GrammarIndex per (spec, vocabulary), shared by the
requests that use the same spec so that their configurations and masks are computed once."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from radixlm.core.runtime.constrained.tokens.counted_string import string_tokens
from radixlm.core.runtime.constrained.automata.grammar import Grammar, choices_grammar, regex_grammar
from radixlm.core.runtime.constrained.automata.grammar_compiler import (DEFAULT_BUDGET, Deadline, GrammarBudget,
                                                                        compile_grammar, terminal_dfa)
from radixlm.core.runtime.constrained.schema.json_grammar import json_schema_to_grammar
from radixlm.core.runtime.constrained.schema.schema_input import load_schema
from radixlm.core.runtime.constrained.schema.schema_prune import prune_definitions
from radixlm.core.runtime.constrained.pda import GrammarIndex
from radixlm.core.runtime.constrained.tokens.first_nodes import first_node
from radixlm.core.runtime.constrained.tokens.terminal_tokens import state_tokens
from radixlm.core.runtime.constrained.tokens.token_classes import EXITS
from radixlm.core.runtime.constrained.tokens.token_walk import token_bytes
from radixlm.core.runtime.constrained.tokens.vocab import TokenVocab, spellable_bytes, vocab_of

CACHE_SIZE = 64

_cache: OrderedDict[tuple, GrammarIndex] = OrderedDict()
_lock = threading.Lock()


_prepare_lock = threading.Lock()
_prepared: "weakref.WeakSet[TokenVocab]" = weakref.WeakSet()  # vocabularies prepare_vocab has done
_gc_lock = threading.Lock()
_gc_pausers = 0  # compiles running with the cyclic garbage collector paused
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while constraints compile. A compile allocates hundreds of
    thousands of small containers (schema copies, rules, automata rows), which set off full collections
    that scanned every live object: ~30 % of the corpus's compile CPU time (bench_compile.py), landing on
    whichever schema was compiling. Compiles are bounded by their time budget, and reference counting
    still frees what they drop; the collector runs again when the last one ends (if it was on)."""
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


def prepare_vocab(tokenizer: Any, eos_token_ids: list[int] | None = None,
                  stop: threading.Event | None = None) -> TokenVocab:
    """What every constraint of this tokenizer needs and no schema changes, built once per process: its
    TokenVocab, byte trie, the vocabulary read as string content (~1.8 s of CPU for Qwen2's 152k tokens:
    vocab_of ~0.8 s, the trie ~0.6 s and its subtrees ~0.1 s, the string read ~0.3 s, the tokens by byte
    ~0.03 s) and the token classes of the terminals most schemas use (prepare_common_terminals). Engines call it on a thread when
    they start, so that the first constrained request does not pay it; anything built later finds it
    cached. A front end and its scheduler in one process both call it: the second finds the vocabulary
    prepared. `stop`, once set, ends the work between two of its parts (the vocabulary is then left
    unprepared: its parts are built when first needed)."""
    with _prepare_lock:
        vocab = vocab_of(tokenizer, eos_token_ids)
        if vocab not in _prepared:
            # the trie with its subtrees' byte sets, ranges and UTF-8 (trie_walk.py), each token's first trie node
            parts = (lambda: vocab.trie.subtrees, lambda: vocab.trie.whole_utf8, lambda: token_bytes(vocab),
                     lambda: first_node(vocab), lambda: vocab.sorted_tokens,
                     lambda: vocab.tokens_by_byte, lambda: spellable_bytes(vocab), lambda: string_tokens(vocab),
                     lambda: string_tokens(vocab, opening=True),
                     lambda: prepare_common_terminals(vocab, stop))  # compiles COMMON_SCHEMA: not a second time
            for part in parts:
                if stop is not None and stop.is_set():
                    return vocab
                part()
            if stop is None or not stop.is_set():
                _prepared.add(vocab)
    return vocab


# A schema whose terminals most JSON schemas meet: numbers, integers, true/false, null, the punctuation,
# literal keys, and a key terminal past its property names (the JSON string body, which keys and string
# patterns share). Token classes are cached by what a terminal state can still read (terminal_tokens.py),
# so any schema's states with the same future find these, whatever their terminal is called.
COMMON_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"},
                                                  "c": {"type": "boolean"}, "d": {"type": "null"},
                                                  "e": {"type": "array", "items": {"type": "string"}}},
                 "required": ["a"], "additionalProperties": {"type": "object"}}
MAX_PREPARED_STATES = 128  # states classified per terminal at most


def prepare_common_terminals(vocab: TokenVocab, stop: threading.Event | None = None) -> None:
    """The token classes (and their exit tries) of every state of COMMON_SCHEMA's terminals, so that a
    first schema's masks do not pay 2-100 ms per state met for the first time (~0.4 s of CPU for Qwen2);
    `stop`, once set, ends it after the state in hand."""
    grammar = compile_grammar(grammar_of("json_schema", COMMON_SCHEMA), DEFAULT_BUDGET)
    for name, dfa in zip(grammar.terminal_names, grammar.terminals):
        for state in range(min(len(dfa.transitions), MAX_PREPARED_STATES)):
            if stop is not None and stop.is_set():
                return
            exits = state_tokens(name, dfa, state, vocab)[EXITS]
            if exits is not None:
                exits.tree.nodes  # walked by pda.py's _exits_taken


def prepare_in_background(tokenizer: Any, eos_token_ids: list[int] | None,
                          then: Callable[[], None] | None = None) -> threading.Event:
    """prepare_vocab on a thread (an engine's start), then `then()` if it succeeded and was not stopped.
    Returns the event that stops it (an engine's close sets it). A tokenizer it cannot read is only logged
    here: the first constraint raises the same error to its request.

    Not a daemon thread: the interpreter's exit waits for it (a part at most, once stopped). A daemon
    thread still inside numpy's C++ code when the interpreter finalizes is ended by pthread_exit as it
    takes the GIL back, and unwinding through those frames aborts the process ("terminate called without
    an active exception")."""
    stop = threading.Event()

    def work() -> None:
        try:
            prepare_vocab(tokenizer, eos_token_ids, stop)
        except Exception as e:  # noqa: BLE001 - reported again, to a request, by build_constraint
            logging.getLogger("radixlm").debug("constrained decoding's tokenizer setup failed: %s", e)
            return
        if then is not None and not stop.is_set():
            then()

    threading.Thread(target=work, name="radixlm-prepare-vocab").start()
    return stop


def grammar_of(kind: str, spec: Any, whitespace_pattern: str | None = None,
               budget: GrammarBudget | None = None, deadline: Deadline | None = None) -> Grammar:
    """The grammar a constraint of `kind` enforces; ValueError naming the problem if `spec` is invalid."""
    if kind == "regex":
        grammar = regex_grammar(spec)
        if terminal_dfa(spec, (budget or DEFAULT_BUDGET).max_terminal_states) is None:
            raise ValueError(f"regex {spec!r} matches no string")
        return grammar
    if kind == "json_schema":
        # Definitions the root cannot reach are dropped before refs are resolved (schema_prune.py).
        schema = prune_definitions(load_schema(spec))
        return json_schema_to_grammar(schema, whitespace_pattern, budget or DEFAULT_BUDGET, deadline)
    if kind == "choices":
        return choices_grammar(spec)
    raise ValueError(f"unknown constraint kind {kind!r}; expected one of ('regex', 'json_schema', 'choices')")


def _spec_key(spec: Any) -> str:
    if isinstance(spec, type) and hasattr(spec, "model_json_schema"):
        spec = spec.model_json_schema()
    try:
        return json.dumps(spec, sort_keys=True)
    except (TypeError, ValueError):
        return repr(spec)


def get_grammar_index(kind: str, spec: Any, vocab: TokenVocab, whitespace_pattern: str | None,
                      budget: GrammarBudget) -> GrammarIndex:
    """The shared GrammarIndex of (kind, spec, whitespace, budget, vocabulary): cached, else compiled."""
    key = (kind, _spec_key(spec), whitespace_pattern, budget, vocab.fingerprint)
    with _lock:
        found = _cache.get(key)
        if found is not None and found.num_states < budget.max_configs // 2:
            _cache.move_to_end(key)
            return found
    # A fresh index once the shared one has used half its budget: old requests keep theirs.
    with gc_paused():
        deadline = Deadline(budget)  # one budget for converting and compiling together
        grammar = grammar_of(kind, spec, whitespace_pattern, budget, deadline)
        index = GrammarIndex(compile_grammar(grammar, budget, deadline), vocab)
    with _lock:
        _cache[key] = index
        if len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return index
