"""Running a compiled grammar over a vocabulary: the pushdown automaton, determinized lazily.

Parser state. An *item* (t, q, k) says: terminal t's DFA is in state q, and when t ends the parse goes
on at continuation k. A continuation is an interned stack frame (rule, rule state, parent continuation)
(-1 = the end of the output), so stacks are persistent and shared. A *configuration* is the closed set
of items the bytes so far allow (every way of parsing them at once, as an Earley set would hold): an
item whose terminal may end here brings in the first items of what follows it. Configurations are
interned to ids; from each one, its 256 successors are computed on first use and kept (a row of one
table), so after warm-up a byte costs one lookup and the grammar behaves like a DFA over the states
generation actually reaches, built as they are reached.

Token masks. A configuration's mask is, per item, the tokens that stay inside its terminal (shared per
terminal state, terminal_tokens.py) and those that leave it mid-token with a suffix that the
configuration where the item's continuation resumes takes: answered once per (terminal state's exits,
continuation) from the suffixes' classes per terminal state (_suffixes_taken), never the bytes inside the
terminal, without stepping configurations. Masks are
cached per configuration; outputs of one schema revisit the same configurations (inside a string, every
character leads back to the same one), so most steps are a cache hit. The tables only grow while
requests run (by at most a few configurations per byte of output); the spec cache
(grammar_index_cache.py) hands new requests a fresh index once one passes half of
GrammarBudget.max_configs, so a running request is never failed for it and memory stays bounded.

Jump-forward. A configuration that cannot end and that exactly one byte leaves is singular; a chain of
singular configurations spells forced text (the compressed FSM of the SGLang paper, on the grammar).
GrammarIndex is shared by the requests of one spec; each request's GrammarConstraint
(grammar_constraint.py) holds its own configuration and drives masks and jump-forward through it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable

import numpy as np
import torch

from radixlm.core.runtime.constrained.tokens.counted_string import CountedStringDFA, string_tokens
from radixlm.core.runtime.constrained.automata.grammar_compiler import CompiledGrammar, terminal_tables
from radixlm.core.runtime.constrained.tokens.literal_tokens import literal_rest
from radixlm.core.runtime.constrained.tokens.masks import MaskCache
from radixlm.core.runtime.constrained.tokens.terminal_tokens import states_tokens
from radixlm.core.runtime.constrained.tokens.token_classes import AFTER_QUOTE, EXITS, Exits, StateTokens, SuffixTree
from radixlm.core.runtime.constrained.tokens.vocab import TokenVocab, set_bits, spellable_bytes, whole_characters

END = (-1, 0, -1)  # the item "the output may end here"
MASK_CACHE_SIZE = 1024
SAME_PIECES_SIZE = 256  # bits per signature of a configuration's classes (19 KB each for Qwen2), see _allowed_bits
MAX_FORCED_BYTES = 4096
MOVES_CACHE_SIZE = 50_000  # item move tables per index (~1 KB each), cleared when full
FEW_STEPS = 8  # bytes stepped one by one from a configuration before its whole row is built
EXITS_CACHE_SIZE = 20_000  # exit tokens taken per (terminal state's exits, continuation), cleared when full
WARM_BYTES = 2  # configurations warmed at compile: up to this many bytes from the start or a resume point


class GrammarIndex:
    """The lazily built automaton of one (compiled grammar, vocabulary) pair; shared by its requests."""

    def __init__(self, grammar: CompiledGrammar, vocab: TokenVocab) -> None:
        self.grammar = grammar
        self.vocab = vocab
        self.token_bytes = vocab.token_bytes
        self.vocab_size = vocab.size
        self.eos_ids = np.asarray(vocab.eos_ids, dtype=np.int64)
        self._eos_set = frozenset(vocab.eos_ids)
        self._trans, self._acc = terminal_tables(grammar)
        self._closed_items: dict[tuple[int, int, int], frozenset] = {}  # see _closed
        self._rule_edges = tuple(r.edges for r in grammar.rules)  # tuples: see terminal_tables
        self._rule_acc = tuple(r.accepting for r in grammar.rules)
        self._conts: dict[tuple[int, int, int], int] = {}
        self._cont_list: list[tuple[int, int, int]] = []
        self._follows: dict[int, frozenset] = {}
        self._config_ids: dict[frozenset, int] = {}
        self._items: list[tuple] = []  # per configuration: its items with a terminal (END aside)
        self._can_end: list[bool] = []
        self._rows: list[tuple[int, ...] | None] = []  # per configuration: successor per byte (-1 = none)
        self._steps: list[dict[int, int]] = []  # per configuration without a row: successors of single bytes
        self._single: list[int] = []  # per configuration with a row: the one byte leaving it, else -1
        self._edges: dict[int, tuple[bytes, int]] = {}
        self._moves: dict[tuple, tuple[np.ndarray, tuple[tuple[int, ...], ...], np.ndarray]] = {}  # see _moves_of
        self._masks = MaskCache(MASK_CACHE_SIZE)
        self._same_pieces: OrderedDict[tuple, tuple[np.ndarray, list[StateTokens]]] = OrderedDict()
        self._counted = {t for t, dfa in enumerate(grammar.terminals) if isinstance(dfa, CountedStringDFA)}
        self._exits: dict[tuple, np.ndarray] = {}  # see _exits_taken
        self._lock = threading.RLock()
        self._spellable = spellable_bytes(vocab)
        self.spells_every_byte = bool(self._spellable.all())
        self.start = self._intern(self._follow(self._cont(grammar.start, 0, -1)))
        self._start_bits: np.ndarray | None = None
        if self._counted:  # the vocabulary read as string content (once per process, ~0.5 s): here, off the loop
            string_tokens(vocab)
            string_tokens(vocab, opening=True)
        # Every output begins at the start configuration: its bits are built with the compile (off the decode
        # loop), not in the first mask, the largest piece of the corpus's mask tail once
        # (benchmarks/results/2026-12-02-grammar-masks.md), and kept (19 KB for a 152k vocabulary).
        self._start_bits = self._walk(self.start)
        self._warm(grammar.budget.warm_seconds)

    def _warm(self, seconds: float) -> None:
        """The token classes and exit walks of the configurations a request most likely meets in its first
        masks, built here with the compile until `seconds` (wall clock) are spent, breadth first: those one
        and two bytes from the start (most outputs' first token is `{"`, `[` or `"`), then where each of
        their items' continuations resumes (a key's value, what follows a value or a key) and one and two
        bytes from there; and with each, its literals' last two states (a key's `":` and `:`, where a
        tokenizer most often splits: `{"name` then `":`). Work the first masks of every new schema did
        fresh, the bulk of the mask tail (benchmarks/results/2026-12-03-grammar-masks-warmup.md); a state or walk a request never
        meets costs only compile time."""
        end = time.monotonic() + seconds
        seen, tails_seen = {self.start}, set()
        queue = deque([(self.start, 0, False)])  # (configuration, bytes from its resume point, past a resume)
        while queue:
            c, depth, resumed = queue.popleft()
            if c != self.start:  # its own pieces are built above
                if time.monotonic() > end:
                    return
                self._pieces(self._items[c])
            for tail in self._literal_tails(c):
                if tail not in tails_seen:
                    if time.monotonic() > end:
                        return
                    tails_seen.add(tail)
                    self._pieces(self._items[tail])
            found = []
            if depth < WARM_BYTES:
                found += [(target, depth + 1, resumed) for target in set(self._row(c)) if target >= 0]
            if not resumed:
                found += [(self._intern(self._follow(k)), 0, True) for k in {k for _, _, k in self._items[c]} if k >= 0]
            for item in found:
                if item[0] not in seen:
                    seen.add(item[0])
                    queue.append(item)

    def _literal_tails(self, c: int) -> list[int]:
        """The configurations that configuration c reaches along the rest of each of its literals (a key's
        name) where WARM_BYTES bytes or fewer of it are left: every item that reads along moves too (a key
        terminal excluding that name, other names with the same prefix), as a request meets them."""
        tails = []
        for t, q, _ in self._items[c]:
            dfa = self.grammar.terminals[t]
            rest = None if isinstance(dfa, CountedStringDFA) else literal_rest(self.grammar.terminal_names[t], dfa, q)
            s = c
            for n, b in enumerate((rest or b"")[:-1]):  # not past its end: there its continuation resumes
                s = self._step(s, b)
                if s < 0:
                    break
                if len(rest) - n - 1 <= WARM_BYTES:
                    tails.append(s)
        return tails

    # ---- configurations ----------------------------------------------------------------------------

    @property
    def num_states(self) -> int:
        return len(self._items)

    def _cont(self, rule: int, state: int, parent: int) -> int:
        if self._rule_acc[rule][state] and not self._rule_edges[rule][state]:
            return parent  # a call in tail position returns straight to the caller: stacks stay flat
        key = (rule, state, parent)
        found = self._conts.get(key)
        if found is None:
            found = self._conts[key] = len(self._cont_list)
            self._cont_list.append(key)
        return found

    def _follow(self, k: int) -> frozenset:
        """The items that start where continuation k resumes (closed: nullable terminals and finished
        rules followed through), END if the output may end there."""
        found = self._follows.get(k)
        if found is not None:
            return found
        if k < 0:
            return frozenset((END,))
        rule, state, parent = self._cont_list[k]
        out: set = set()
        for symbol, target in self._rule_edges[rule][state]:
            after = self._cont(rule, target, parent)
            if symbol % 2 == 0:
                t = symbol >> 1
                out.add((t, 0, after))
                if self._acc[t][0]:
                    out |= self._follow(after)
            else:
                out |= self._follow(self._cont(symbol >> 1, 0, after))
        if self._rule_acc[rule][state]:
            out |= self._follow(parent)
        found = self._follows[k] = frozenset(out)
        return found

    def _intern(self, items: frozenset) -> int:
        found = self._config_ids.get(items)
        if found is not None:
            return found
        c = len(self._items)
        self._config_ids[items] = c
        self._items.append(tuple(sorted(i for i in items if i[0] >= 0)))
        self._can_end.append(END in items)
        self._rows.append(None)
        self._steps.append({})
        self._single.append(-1)
        return c

    def _row(self, c: int) -> tuple[int, ...]:
        """Configuration c's successor per byte, built on first use."""
        row = self._rows[c]
        if row is not None:
            return row
        with self._lock:
            if self._rows[c] is not None:
                return self._rows[c]
            items = self._items[c]
            out = np.full(256, -1, dtype=np.int32)
            live = ()
            if items:
                live, columns, inverse = self._moves_of(items)
                targets = [self._intern(self._close([(t, q2, k) for (t, _, k), q2 in zip(items, column) if q2 >= 0]))
                           for column in columns]
                out[live] = np.asarray(targets, dtype=np.int32)[inverse]
            self._single[c] = int(live[0]) if len(live) == 1 and not self._can_end[c] else -1
            row = self._rows[c] = tuple(out.tolist())  # a tuple of ints: the collector stops walking it
            self._steps[c] = {}
            return row

    def _step(self, c: int, b: int) -> int:
        """Configuration c's successor on byte b (-1 = none), without building its row: advancing reads
        one or two bytes of most configurations it meets, and a whole row (~50 µs in Python) costs ten
        single bytes. Agrees with _row: the same moved items, closed and interned alike."""
        row = self._rows[c]
        if row is not None:
            return row[b]
        steps = self._steps[c]
        found = steps.get(b)
        if found is None:
            if len(steps) >= FEW_STEPS:  # many bytes read here (a string's content): the row shares their moves
                return self._row(c)[b]
            with self._lock:
                moved = [(t, q2, k) for t, q, k in self._items[c] if (q2 := int(self._trans[t][q, b])) >= 0]
                found = steps[b] = self._intern(self._close(moved)) if moved and self._spellable[b] else -1
        return found

    def _moves_of(self, items: tuple) -> tuple[np.ndarray, tuple[tuple[int, ...], ...], np.ndarray]:
        """(the bytes some item can read, the distinct columns of item moves on them, each byte's column).
        Depends only on the items' terminal states, not on their continuations, so configurations that
        differ only in their stacks (a string value under different keys) share it."""
        key = tuple((t, q) for t, q, _ in items)
        found = self._moves.get(key)
        if found is None:
            # Terminals are named by what they match: schemas share their tables (JSON strings, numbers).
            names = self.grammar.terminal_names
            shared = (tuple((names[t], q) for t, q in key), self.vocab.fingerprint)
            with _shared_lock:
                found = _shared_moves.get(shared)
                if found is not None:
                    _shared_moves.move_to_end(shared)
            if found is None:
                nxt = np.stack([self._trans[t][q] for t, q in key])  # [items, 256]
                # Bytes no token contains can never be written.
                live = np.flatnonzero((nxt >= 0).any(axis=0) & self._spellable).astype(np.uint8)
                # Bytes with equal item moves (most of them, inside a string) share the target.
                moves, inverse = _unique_columns(nxt[:, live], self._radix(items))
                # Columns as tuples of ints, which the cyclic collector stops tracking (kept for the process).
                found = (live, tuple(map(tuple, moves.T.tolist())), inverse.astype(np.int16))
                with _shared_lock:
                    _shared_moves[shared] = found
                    if len(_shared_moves) > SHARED_MOVES:
                        _shared_moves.popitem(last=False)
            if len(self._moves) >= MOVES_CACHE_SIZE:
                self._moves.clear()
            self._moves[key] = found
        return found

    def _radix(self, items: tuple) -> np.ndarray | None:
        """Per item, the place value of its move in one int64 column key (moves -1..n-1 of an n-state
        terminal as digits 0..n), or None when the key would not fit in 63 bits."""
        sizes = [len(self._trans[t]) + 1 for t, _, _ in items]
        if sum(s.bit_length() for s in sizes) > 62:
            return None
        return np.cumprod([1] + sizes[:-1], dtype=np.int64)

    def _close(self, items: list) -> frozenset:
        """The items plus what follows those whose terminal may end; an item at the end of its terminal
        (accepting, no byte goes on) is left out: it can read nothing more. Item by item (each one's
        closure kept), so the common move of one item costs a lookup and no new set."""
        if len(items) == 1:
            return self._closed(items[0])
        return frozenset().union(*map(self._closed, items))

    def _closed(self, item: tuple[int, int, int]) -> frozenset:
        found = self._closed_items.get(item)
        if found is None:
            t, q, k = item
            if not self._acc[t][q]:
                found = frozenset((item,))
            elif (self._trans[t][q] >= 0).any():
                found = self._follow(k) | {item}
            else:
                found = self._follow(k)
            self._closed_items[item] = found
        return found

    # ---- the interface GrammarConstraint drives ---------------------------------------------------

    def is_eos(self, token_id: int) -> bool:
        return token_id in self._eos_set

    def is_accepting(self, state: int) -> bool:
        return self._can_end[state]

    def is_terminal(self, state: int) -> bool:
        """The output may end here and no byte may follow."""
        return self._can_end[state] and max(self._row(state)) < 0

    def next_state(self, state: int, token_id: int) -> int:
        """The configuration after `token_id`, or -1 if it is not allowed (EOS and special tokens included)."""
        if not 0 <= token_id < len(self.token_bytes) or token_id in self._eos_set:
            return -1
        data = self.token_bytes[token_id]
        if not data:
            return -1
        for b in data:
            state = self._step(state, b)
            if state < 0:
                return -1
        return state

    def edge(self, state: int) -> tuple[bytes, int]:
        """(forced bytes from `state`, the configuration after them); (b"", state) when nothing is forced."""
        found = self._edges.get(state)
        if found is not None:
            return found
        path, s = bytearray(), state
        while len(path) < MAX_FORCED_BYTES:
            row = self._row(s)
            b = self._single[s]
            if b < 0:
                break
            path.append(b)
            s = row[b]
        found = self._edges[state] = (bytes(path), s)
        return found

    def forced_text(self, state: int) -> str | None:
        return whole_characters(self.edge(state)[0])

    def byte_successors(self, state: int) -> tuple[int, ...]:
        """The configuration after each byte from `state` (-1: the byte is not allowed)."""
        return self._row(state)

    def allowed_tokens(self, state: int) -> np.ndarray:
        """Sorted ids of the tokens allowed from `state`, EOS excluded."""
        allowed = self.mask(state, self.vocab_size).numpy().copy()
        allowed[self.eos_ids[self.eos_ids < self.vocab_size]] = False
        return np.flatnonzero(allowed).astype(np.int32)

    def mask(self, state: int, vocab_size: int, packed: bool = False) -> torch.Tensor:
        """Allowed next tokens over `vocab_size` ids, cached (see MaskCache): bool, or packed int32 words.
        Shared between requests: never write to it."""
        return self._masks.get(state, vocab_size, packed, lambda width: self._allowed_bits(state, width))

    def _allowed_bits(self, state: int, vocab_size: int) -> np.ndarray:
        """Packed bits (little bit order), uint8 [4 * ceil(vocab_size / 32)]. A counted string's positions
        are configurations of their own whose classes repeat: there the bits are kept per signature (the
        items' classes and continuations), the classes held with them so that their ids stay theirs."""
        items = self._items[state]
        if not any(t in self._counted for t, _, _ in items):
            return self._computed_bits(state, vocab_size, None)
        with self._lock:
            classes = self._classes(items)
        signature = (tuple((id(c), k if c[EXITS] is not None or c[AFTER_QUOTE] is not None else -2) for c, (_, _, k)
                           in zip(classes, items)), self._can_end[state], vocab_size, state == self.start)
        with self._lock:
            found = self._same_pieces.get(signature)
            if found is not None:
                self._same_pieces.move_to_end(signature)
                return found[0]
        allowed = self._computed_bits(state, vocab_size, classes)
        with self._lock:
            self._same_pieces[signature] = (allowed, classes)
            if len(self._same_pieces) > SAME_PIECES_SIZE:
                self._same_pieces.popitem(last=False)
        return allowed

    def _computed_bits(self, state: int, vocab_size: int, classes: list[StateTokens]) -> np.ndarray:
        width = -(-vocab_size // 32) * 4
        if vocab_size >= self.vocab_size:  # the walk's bits padded to the width: no second array to copy into
            with self._lock:
                allowed = self._walk(state, width, classes)
        else:  # logits narrower than the vocabulary: drop the ids past them
            with self._lock:
                walked = self._walk(state, 0, classes)
            walked = np.packbits(np.unpackbits(walked, count=vocab_size, bitorder="little"), bitorder="little")
            allowed = np.zeros(width, dtype=np.uint8)
            allowed[:len(walked)] = walked
        if self._can_end[state]:
            eos = self.eos_ids[self.eos_ids < vocab_size]
            set_bits(allowed, eos)
        return allowed

    def _walk(self, state: int, width: int = 0, classes: list[StateTokens] | None = None) -> np.ndarray:
        """Packed bits [max(width, ceil(vocab / 8))]: the tokens whose bytes all lead somewhere from `state`."""
        whole = -(-self.vocab_size // 8)
        packed = np.zeros(max(width, whole), dtype=np.uint8)
        bits = packed[:whole]  # the width the classes' bits have
        if state == self.start and self._start_bits is not None:
            bits[:] = self._start_bits
            return packed
        insides, ids = self._pieces(self._items[state], classes)
        for inside in insides:
            bits |= inside
        if ids:
            set_bits(packed, np.concatenate(ids))  # in one pass
        return packed

    def _classes(self, items: Iterable[tuple[int, int, int]]) -> list[StateTokens]:
        """The token classes of each item's terminal state (terminal_tokens.py's shared cache)."""
        names, terminals = self.grammar.terminal_names, self.grammar.terminals
        return states_tokens([(names[t], terminals[t], q) for t, q, _ in items], self.vocab)

    def _pieces(self, items: Iterable[tuple[int, int, int]], classes: list[StateTokens] | None = None,
                ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The tokens `items` allow, in pieces: (packed bits, arrays of ids). For each item, the tokens
        that stay inside its terminal (shared per terminal state, terminal_tokens.py), and those leaving it
        mid-token whose suffix the item's continuation takes."""
        items = list(items)
        insides, ids = [], []  # packed bits, arrays of ids
        seen: set[int] = set()  # classes by identity: items of one terminal state share its inside tokens
        for c, (_, _, k) in zip(classes or self._classes(items), items):
            inside, exits, inside_ids, closing, after_quote = c
            if id(c) not in seen:
                seen.add(id(c))
                if inside is None:
                    ids.append(inside_ids)
                else:
                    insides.append(inside)
            if exits is not None:
                ids.append(self._exits_taken(exits, k))
            if closing is not None and after_quote is not None:
                # The tokens that close a counted string and whose bytes after the quote lead somewhere
                # from where k resumes: those taken by k (a few hundred ids) that close within its bounds.
                taken = self._exits_taken(after_quote, k)
                ids.append(taken[((closing[taken >> 3] >> (taken & 7)) & 1).astype(bool)])
        return insides, ids

    def _exits_taken(self, exits: Exits, k: int) -> np.ndarray:
        """Ids of the tokens among `exits` whose suffix leads somewhere from where continuation k resumes
        (the configuration after the terminal ends); one walk per (exits, continuation)."""
        key = (exits, k)  # by identity: the key holds the Exits, so its id is never reused
        found = self._exits.get(key)
        if found is None:
            tree = exits.tree
            suffixes = self._suffixes_taken(tree, 0, self._follow(k))
            found = exits.tokens_of(suffixes) if suffixes else _NO_TOKENS  # a third take none
            if len(self._exits) >= EXITS_CACHE_SIZE:
                self._exits.clear()
            self._exits[key] = found
        return found

    def _suffixes_taken(self, tree: SuffixTree, node: int, items: frozenset) -> list[int]:
        """Ids of the suffixes below `node` of `tree` whose bytes all lead somewhere from the configuration
        of `items` (as _follow gives them, not interned: a walk needs only the items). It takes a suffix
        iff one of its items does: by staying inside the item's terminal, or by ending it part way and
        going on from what follows the item. The first part depends on the terminal state
        alone (SuffixTree.classes, shared by every continuation and schema); past the points where the
        terminal may end, the rest is the same question from the configuration where the item resumes.
        So no configuration is stepped: suffixes die or stay inside their first terminals at once (after
        a number only `,` `}` `]` go on, say)."""
        names, terminals = self.grammar.terminal_names, self.grammar.terminals
        alive: list[int] = []
        for t, q, after in items:
            if t < 0:  # END: the output may end here, no suffix goes on
                continue
            inside, ends_at = tree.classes(node, names[t], terminals[t], q)
            alive += inside
            if ends_at:
                resume = self._follow(after)
                for sub in ends_at:
                    alive += self._suffixes_taken(tree, sub, resume)
        return alive


_NO_TOKENS = np.zeros(0, dtype=np.int64)
_NO_TOKENS.flags.writeable = False

# Item move tables by (terminal names and states, vocabulary), shared by every index of the process.
_shared_moves: OrderedDict[tuple, tuple[np.ndarray, tuple[tuple[int, ...], ...], np.ndarray]] = OrderedDict()
_shared_lock = threading.Lock()
SHARED_MOVES = 20_000  # entries (~1 KB each)


def _unique_columns(moves: np.ndarray, radix: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(distinct columns of `moves` [items, bytes], each byte's column index among them). With a radix
    every column is one exact int64 key, so a 1-D unique does it (np.unique over axis 1 sorts rows of
    a structured view: ~10x slower, and this runs for every configuration met)."""
    if radix is None:
        found, inverse = np.unique(moves, axis=1, return_inverse=True)
        return found, inverse.reshape(-1)
    keys = radix @ (moves.astype(np.int64) + 1)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    return moves[:, first], inverse.reshape(-1)
