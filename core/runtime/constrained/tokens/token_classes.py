"""What a terminal state's token classes are made of (terminal_tokens.py computes them, pda.py joins them
into masks): the tokens that stay inside the terminal, and the exits, the tokens that may leave it
mid-token, as the distinct suffixes they leave with (a SuffixTree) and the (suffix, token) pairs."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from radixlm.core.runtime.constrained.tokens.literal_tokens import literal_rest
from radixlm.core.runtime.constrained.tokens.narrow_walk import moves_of
from radixlm.core.runtime.constrained.automata.regex_dfa import ByteDFA, byte_trie
from radixlm.core.runtime.constrained.tokens.vocab import TokenVocab

CLASSES_PER_TREE = 4096  # (node, terminal, state) entries per SuffixTree, cleared when full
TAKEN_SETS = 256  # sets of suffixes taken kept per Exits, cleared when full


class SuffixTree:
    """Distinct exit suffixes (sorted) as a trie of numbered nodes (0: the root), and their classes per
    terminal state. One per distinct list of suffixes (suffix_tree), shared by the Exits that have it:
    states with different subtrees often leave with the same suffixes (a string's closing quote and what
    follows it)."""

    def __init__(self, suffixes: list[bytes]) -> None:
        self.suffixes = suffixes
        self._classes: dict[tuple[int, str, int], tuple[tuple[int, ...], tuple[int, ...]]] = {}

    @functools.cached_property
    def nodes(self) -> tuple[list[dict[int, int]], list[tuple[int, ...]]]:
        """Per node, its children as {byte: node} and the ids of the suffixes ending at it. Dicts and
        tuples of numbers only: Python's collector does not track them (a dict of numbers never, a tuple
        after its first collection), so a full collection walks two lists a tree, not three objects a node
        (narrow_walk's rows say why that matters)."""
        children, suffix_ends = byte_trie(self.suffixes)
        ends: list[tuple[int, ...]] = [()] * len(children)
        for n, node in enumerate(suffix_ends):
            ends[node] += (n,)
        return children, ends

    def classes(self, node: int, key: str, dfa: ByteDFA, state: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The suffixes below `node` (the root, 0, or a node after which a terminal may end) read from
        `state` of terminal `dfa` (named `key`), as the vocabulary is in state_tokens: (ids of those alive
        in the terminal through their last byte, the nodes after which the terminal may end and the rest
        go on from whatever follows it). Context-independent, so cached per (node, terminal, state):
        pda.py's exit walks need nothing else inside a terminal."""
        found = self._classes.get((node, key, state))
        if found is not None:
            return found
        rest = literal_rest(key, dfa, state)
        if rest is not None:
            found = self._literal_classes(node, rest)
        else:
            children, ends = self.nodes
            inside: list[int] = []
            ends_at: list[int] = []
            accepting = dfa.accepting
            stack = [(state, node)]
            while stack:
                q, at = stack.pop()
                moves, below = moves_of(key, dfa, q), children[at]
                # The fewer of the two: a literal's one move among a root's ~50 first bytes, or a
                # string body's ~200 moves against a node's few children.
                if len(moves) < len(below):
                    pairs = [(t, below[b]) for b, t in moves.items() if b in below]
                else:
                    pairs = [(moves[b], child) for b, child in below.items() if b in moves]
                for nxt, child in pairs:
                    inside += ends[child]
                    if children[child]:
                        if accepting[nxt]:
                            ends_at.append(child)
                        stack.append((nxt, child))
            found = (tuple(inside), tuple(ends_at))
        if len(self._classes) >= CLASSES_PER_TREE:
            self._classes.clear()
        self._classes[node, key, state] = found
        return found

    def _literal_classes(self, node: int, rest: bytes) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """classes() from a literal's state with `rest` left: one path down the tree, the terminal ending
        only after rest's last byte."""
        children, ends = self.nodes
        inside: list[int] = []
        for b in rest:
            node = children[node].get(b, -1)
            if node < 0:
                return tuple(inside), ()
            inside += ends[node]
        return tuple(inside), (node,) if children[node] else ()


_trees: dict[tuple[bytes, ...], SuffixTree] = {}
TREES = 4096


def suffix_tree(suffixes: list[bytes]) -> SuffixTree:
    """The SuffixTree of these distinct sorted suffixes, shared process-wide."""
    key = tuple(suffixes)
    found = _trees.get(key)
    if found is None:
        if len(_trees) >= TREES:
            _trees.clear()
        found = _trees.setdefault(key, SuffixTree(suffixes))
    return found


@dataclass(eq=False)
class Exits:
    """Tokens that may leave a terminal state mid-token: the distinct suffixes they leave it with (as a
    tree), and the (suffix, token) pairs."""

    tree: SuffixTree
    pair_suffix: np.ndarray  # int64 [pairs]: index into tree.suffixes
    pair_token: np.ndarray  # int64 [pairs]: token id
    # Tokens per set of suffixes taken (see tokens_of); a corpus run has ~30 Exits walked ~4,600 times
    # under fresh continuations, and 95 % of those walks take a set of suffixes already met.
    _taken: dict[frozenset, np.ndarray] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, tokens: list[int], suffixes: list[bytes]) -> "Exits":
        """From pairs: token tokens[i] leaves with suffixes[i] (non-empty)."""
        distinct = sorted(set(suffixes))
        index = {x: n for n, x in enumerate(distinct)}
        return cls(suffix_tree(distinct), np.fromiter(map(index.__getitem__, suffixes), np.int64, count=len(suffixes)),
                   np.asarray(tokens, dtype=np.int64))

    def tokens_of(self, suffixes: list[int]) -> np.ndarray:
        """Ids of the tokens that leave with one of `suffixes` (ids into tree.suffixes); read-only, kept
        per set of suffixes: the walks under different continuations mostly take the same few sets."""
        key = frozenset(suffixes)
        found = self._taken.get(key)
        if found is None:
            taken = np.zeros(len(self.tree.suffixes), dtype=bool)
            taken[suffixes] = True
            found = self.pair_token[taken[self.pair_suffix]]
            found.flags.writeable = False
            if len(self._taken) >= TAKEN_SETS:
                self._taken.clear()
            self._taken[key] = found
        return found


# A terminal state's token classes: a plain tuple (inside, exits, inside_ids, closing, after_quote), read
# with the indices below. CPython's collector stops tracking a tuple whose items it does not track (arrays,
# None): a corpus run keeps ~3.5k of them, most without exits, which as class instances every full
# collection walked (~15k tracked objects were left after a run, and a collection inside a mask costs
# ~1 µs an object).
StateTokens = tuple
INSIDE, EXITS, INSIDE_IDS, CLOSING, AFTER_QUOTE = range(5)


def state_classes(inside: np.ndarray | None, exits: Exits | None = None, *, inside_ids: np.ndarray | None = None,
                  closing: np.ndarray | None = None, after_quote: Exits | None = None) -> StateTokens:
    """inside: uint8 packed bits (little bit order) of the context-independent tokens, or None where a
    literal's few inside tokens are given as `inside_ids` instead (a mask sets them with its exits' in one
    pass, rather than packing and OR-ing 19 KB of bits per fresh state); exits: the tokens that may leave
    the terminal mid-token. Counted string boundaries: `closing`, packed bits of the tokens that close the
    string and go on after the quote, and their bytes after the quote as `after_quote` (exits is then
    None)."""
    return inside, exits, inside_ids, closing, after_quote


def exits_replacing(base: Exits | None, ids: np.ndarray, tokens: np.ndarray, starts: np.ndarray,
                    vocab: TokenVocab) -> Exits | None:
    """`base`'s exit pairs less those of tokens `ids`, and the pairs (tokens, where their suffix starts)."""
    token_bytes = vocab.token_bytes
    new = [token_bytes[t][j:] for t, j in zip(tokens.tolist(), starts.tolist())]
    if base is None:
        return Exits.build(tokens.tolist(), new) if new else None
    keep = ~np.isin(base.pair_token, ids, kind="table")
    old = base.tree.suffixes
    kept = np.unique(base.pair_suffix[keep]).tolist()  # often none: a string body's exits all cross `"`
    distinct = sorted({old[i] for i in kept}.union(new))
    if not distinct:
        return None
    index = {x: n for n, x in enumerate(distinct)}
    remap = np.full(len(old), -1, dtype=np.int64)
    remap[kept] = [index[old[i]] for i in kept]
    return Exits(suffix_tree(distinct),
                 np.concatenate([remap[base.pair_suffix[keep]], np.fromiter(map(index.__getitem__, new), np.int64,
                                                                            count=len(new))]),
                 np.concatenate([base.pair_token[keep], tokens.astype(np.int64)]))
