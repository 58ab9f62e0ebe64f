"""What each token id of a tokenizer writes, as bytes, and a byte trie over the whole vocabulary.

Supported token spellings: byte-level BPE (GPT-2's byte-to-unicode alphabet: Llama 3, Qwen2, GPT-2) and
SentencePiece style (`▁` for a space, `<0xNN>` byte-fallback tokens: Llama 2, Mistral). Special tokens
write nothing (b"") and so are never allowed by a constraint; EOS is handled apart by the index.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np

from radixlm.core.runtime.constrained.tokens.utf8 import whole_below

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100 on."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[chr(b)] = b
        else:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


def _decoder_kinds(tokenizer_backend) -> set[str]:
    """Types named anywhere in the backend's decoder (and the `▁` replacement, if any)."""
    decoder = getattr(tokenizer_backend, "decoder", None)
    if decoder is None:
        return set()
    kinds: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, dict):
            if "type" in node:
                kinds.add(node["type"])
            if node.get("type") == "Replace" and node.get("pattern", {}).get("String") == "▁":
                kinds.add("ReplaceMetaspace")
            for v in node.values():
                visit(v)
        elif isinstance(node, list):
            for v in node:
                visit(v)

    visit(json.loads(decoder.__getstate__()))
    return kinds


def token_bytes_of(tokenizer) -> tuple[list[bytes], set[int]]:
    """(bytes per token id, special token ids) for an HF fast tokenizer or a `tokenizers.Tokenizer`."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "get_vocab") or not hasattr(backend, "get_added_tokens_decoder"):
        raise ValueError(f"constrained decoding needs a fast (Rust-backed) tokenizer, got {type(tokenizer).__name__}")
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
    added = backend.get_added_tokens_decoder()
    special = {i for i, tok in added.items() if tok.special}
    special |= set(getattr(tokenizer, "all_special_ids", []) or [])
    kinds = _decoder_kinds(backend)
    byte_level = "ByteLevel" in kinds
    byte_fallback = "ByteFallback" in kinds
    metaspace = "Metaspace" in kinds or "ReplaceMetaspace" in kinds
    u2b = _unicode_to_byte()

    out = [b""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        if i in special:
            continue
        if i in added:  # added tokens are written as they are, outside the byte-level alphabet
            out[i] = added[i].content.encode()
        elif byte_level:
            out[i] = bytes(u2b[c] for c in text) if all(c in u2b for c in text) else text.encode()
        elif byte_fallback and (m := _BYTE_FALLBACK.fullmatch(text)):
            out[i] = bytes([int(m.group(1), 16)])
        elif metaspace:
            out[i] = text.replace("▁", " ").encode()
        else:
            out[i] = text.encode()
    return out, special


def expand_ranges(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ranges [starts[i], starts[i] + counts[i]) (a trie level's child or end-token slices): (owner i of
    each element, the element)."""
    owner = np.repeat(np.arange(len(starts)), counts)
    return owner, np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))


def byte_matrix(data: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """The byte strings `data` as one zero-padded uint8 matrix [len(data), longest] and their lengths,
    built in a few numpy calls (no per-string loop)."""
    lens = np.fromiter(map(len, data), dtype=np.int64, count=len(data))
    flat = np.frombuffer(b"".join(data), dtype=np.uint8)
    rows = np.repeat(np.arange(len(data)), lens)
    cols = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
    mat = np.zeros((len(data), max(int(lens.max(initial=0)), 1)), dtype=np.uint8)
    mat[rows, cols] = flat
    return mat, lens


FEW_IDS = 32  # ids set one by one in Python: np.bitwise_or.at costs ~4-9 µs a call, the loop ~0.1 µs an id


def set_bits(packed: np.ndarray, ids: np.ndarray) -> None:
    """Sets the bits of token `ids` in a packed mask (uint8, contiguous; little-endian bit order within
    each byte)."""
    if len(ids) <= FEW_IDS:  # a fresh configuration's exits and literals: a median of 5 ids
        view = memoryview(packed)
        for i in ids.tolist():
            view[i >> 3] |= 1 << (i & 7)
        return
    np.bitwise_or.at(packed, ids >> 3, (1 << (ids & 7)).astype(np.uint8))


def clear_bits(packed: np.ndarray, ids: np.ndarray) -> None:
    """Clears the bits of token `ids` (int64) in a packed mask, as set_bits sets them."""
    np.bitwise_and.at(packed, ids >> 3, (~(1 << (ids & 7))).astype(np.uint8))


def whole_characters(data: bytes) -> str | None:
    """`data` cut to whole UTF-8 characters (forced bytes may end inside one), or None if nothing is left."""
    for cut in range(len(data), max(len(data) - 4, 0), -1):
        try:
            return data[:cut].decode() or None
        except UnicodeDecodeError:
            continue
    return None


@dataclass(eq=False)
class TokenTrie:
    """The vocabulary's byte strings as a trie stored level by level (depth d = the d-th byte).

    Level d's nodes are the distinct d-byte prefixes, in lexicographic order, so the children of one
    node of level d-1 are contiguous: children of node p are level-d nodes child_ptr[d][p]:child_ptr[d][p+1].
    Token ids whose bytes end at a level-d node q: end_tokens[d][end_ptr[d][q]:end_ptr[d][q+1]].
    Index 0 of each list is a placeholder for the root level.
    """

    byte: list[np.ndarray]
    child_ptr: list[np.ndarray]
    end_ptr: list[np.ndarray]
    end_tokens: list[np.ndarray]
    first_byte_weight: np.ndarray  # [256]: how many nodes lie under each first byte

    _levels: tuple | None = field(default=None, repr=False)

    @property
    def num_nodes(self) -> int:
        return int(self.first_byte_weight.sum())

    def level_arrays(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per level d: the parent (level d-1 node) of each node, and the node each of end_tokens[d]
        ends at; for walks that visit whole levels at once."""
        if self._levels is None:
            parents, ends = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
            for d in range(1, self.depth + 1):
                ptr, eptr = self.child_ptr[d], self.end_ptr[d]
                parents.append(np.repeat(np.arange(len(ptr) - 1), np.diff(ptr)))
                ends.append(np.repeat(np.arange(len(eptr) - 1), np.diff(eptr)))
            self._levels = (parents, ends)
        return self._levels

    def step(self, d: int, nodes: np.ndarray, states: np.ndarray, table: np.ndarray,
             dense: bool) -> tuple[np.ndarray, np.ndarray]:
        """The level-d nodes under the level-(d-1) `nodes` (in automaton `states`) whose byte `table`
        moves to a state (>= 0), and those states. Dense: every level-d node through its parent's state
        (cheaper when many nodes are alive); sparse: only the children of `nodes`."""
        ptr = self.child_ptr[d]
        if dense:
            at = np.full(len(ptr) - 1, -1, dtype=np.int64)
            at[nodes] = states
            src = at[self.level_arrays()[0][d]]
            nxt = table[np.maximum(src, 0), self.byte[d]]
            nxt[src < 0] = -1
            nodes = np.flatnonzero(nxt >= 0)
            return nodes, nxt[nodes].astype(np.int64)
        parent, child = expand_ranges(ptr[nodes], ptr[nodes + 1] - ptr[nodes])
        nxt = table[states[parent], self.byte[d][child]]
        keep = nxt >= 0
        return child[keep], nxt[keep].astype(np.int64)

    def mark_ends(self, d: int, nodes: np.ndarray, out: np.ndarray, dense: bool) -> None:
        """Sets out[t] for every token t that ends at one of the level-d `nodes` (dense: through a mask
        of the level, cheaper when many nodes are given)."""
        if dense:
            alive = np.zeros(len(self.byte[d]), dtype=bool)
            alive[nodes] = True
            out[self.end_tokens[d][alive[self.level_arrays()[1][d]]]] = True
        else:
            eptr = self.end_ptr[d]
            _, idx = expand_ranges(eptr[nodes], eptr[nodes + 1] - eptr[nodes])
            out[self.end_tokens[d][idx]] = True

    @functools.cached_property
    def subtrees(self) -> tuple[list[list[np.ndarray]], list[np.ndarray], list[np.ndarray], np.ndarray]:
        """Per level d: the bytes read strictly below each node (a 256-bit set as 4 uint64 [nodes] words), where its
        tokens (those ending at it or below) start in the sorted vocabulary and how many they are; and the
        token ids in that sorted order (int32). A walk takes a subtree whole from these (trie_walk.py)."""
        depth = self.depth
        below = [np.zeros((len(self.byte[d]), 4), np.uint64) for d in range(depth + 1)]
        count = [np.diff(self.end_ptr[d]) for d in range(depth + 1)]
        for d in range(depth, 1, -1):  # children before parents: a node's set and count are its children's
            parents = self.level_arrays()[0][d]
            own = below[d].copy()
            byte = self.byte[d].astype(np.int64)
            own[np.arange(len(byte)), byte >> 6] |= np.left_shift(np.uint64(1), (byte & 63).astype(np.uint64))
            for word in range(4):
                np.bitwise_or.at(below[d - 1][:, word], parents, own[:, word])
            count[d - 1] = count[d - 1] + np.bincount(parents, weights=count[d], minlength=len(count[d - 1])).astype(np.int64)
        first = [np.zeros(0, np.int64), np.cumsum(count[1]) - count[1]]
        order = np.zeros(int(count[1].sum()), dtype=np.int32)
        for d in range(1, depth + 1):
            ends = np.diff(self.end_ptr[d])
            at = np.repeat(first[d] - self.end_ptr[d][:-1], ends) + np.arange(int(ends.sum()))
            order[at] = self.end_tokens[d]  # the tokens ending at a node come first in its range
            if d < depth:
                parents = self.level_arrays()[0][d + 1]
                before = np.cumsum(count[d + 1]) - count[d + 1]  # siblings before a child, and the parent's earlier ones
                first_child = self.child_ptr[d + 1][:-1]
                sibling_start = np.where(first_child < len(before), before[np.minimum(first_child, len(before) - 1)], 0)
                first.append(first[d][parents] + ends[parents] + before - sibling_start[parents])
        words = [[np.ascontiguousarray(x[:, w]) for w in range(4)] for x in below]  # gathered one word at a time
        return words, first, count, order

    @functools.cached_property
    def whole_utf8(self) -> list[np.ndarray]:
        """Per level d: bool [nodes], the node ends a character and every path below it is valid UTF-8
        (utf8.whole_below; a walk takes such a subtree whole from a transparent state, trie_walk.py)."""
        return whole_below(self.byte, self.level_arrays()[0])

    @functools.cached_property
    def views(self) -> tuple[list[memoryview], list[memoryview], list[memoryview]]:
        """byte, child_ptr and end_ptr as memoryviews: their items read as Python ints (and bisect searches
        them), for walks that visit a few nodes at a time, where numpy scalars cost more than the work."""
        return tuple([memoryview(x) for x in arrays] for arrays in (self.byte, self.child_ptr, self.end_ptr))

    @property
    def depth(self) -> int:
        return len(self.byte) - 1

    @classmethod
    def build(cls, token_bytes: list[bytes], ids: list[int] | None = None) -> "TokenTrie":
        """The trie of all non-empty tokens, or of the tokens `ids` only (ids keep their numbering)."""
        ids = [i for i, b in enumerate(token_bytes) if b] if ids is None else [i for i in ids if token_bytes[i]]
        ids.sort(key=token_bytes.__getitem__)
        n = len(ids)
        mat, lens = byte_matrix([token_bytes[i] for i in ids])
        width = mat.shape[1]
        # Longest common prefix with the previous token in sorted order (-1 for the first).
        same = mat[1:] == mat[:-1]
        first_diff = np.where(same.all(axis=1), width, np.argmin(same, axis=1))
        lcp = np.concatenate([[-1], np.minimum(first_diff, np.minimum(lens[1:], lens[:-1]))])
        token_ids = np.asarray(ids, dtype=np.int32)

        byte, child_ptr, end_ptr, end_tokens = [np.zeros(0, np.uint8)], [np.zeros(1, np.int64)], [np.zeros(2, np.int64)], [np.zeros(0, np.int32)]
        prev_node = np.zeros(n, dtype=np.int64)  # every token's node at level d-1 (root at level 0)
        prev_count = 1
        weight = np.zeros(256, dtype=np.int64)
        for d in range(1, width + 1):
            has = lens >= d
            new = has & (lcp < d)
            node = np.cumsum(new) - 1  # valid where `has`
            starts = np.flatnonzero(new)
            byte.append(mat[starts, d - 1].copy())
            weight += np.bincount(mat[starts, 0], minlength=256)
            child_ptr.append(np.searchsorted(prev_node[starts], np.arange(prev_count + 1)))
            ending = np.flatnonzero(lens == d)
            owner = node[ending]  # sorted, since tokens are
            end_ptr.append(np.searchsorted(owner, np.arange(len(starts) + 1)))
            end_tokens.append(token_ids[ending])
            prev_node = np.where(has, node, 0)
            prev_count = len(starts)
        return cls(byte, child_ptr, end_ptr, end_tokens, weight)


@dataclass(eq=False)
class TokenVocab:
    """A tokenizer's vocabulary as the index needs it; one per (tokenizer, EOS ids), cached."""

    token_bytes: list[bytes]
    special_ids: frozenset[int]
    eos_ids: tuple[int, ...]
    fingerprint: str
    _trie: TokenTrie | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    @property
    def trie(self) -> TokenTrie:
        if self._trie is None:
            self._trie = TokenTrie.build(self.token_bytes)
        return self._trie

    @functools.cached_property
    def tokens_by_byte(self) -> tuple[np.ndarray, np.ndarray]:
        """The ids (int64) of the tokens containing each byte value: ids[ptr[b]:ptr[b + 1]] for byte b."""
        n = self.size
        owner = np.repeat(np.arange(n), np.fromiter(map(len, self.token_bytes), np.int64, count=n))
        flat = np.frombuffer(b"".join(self.token_bytes), dtype=np.uint8)
        order = np.argsort(flat, kind="stable")  # by byte, then token (a radix sort of uint8)
        flat, owner = flat[order], owner[order]
        first = np.ones(len(flat), dtype=bool)  # a token's repeats of a byte are neighbours now
        first[1:] = (flat[1:] != flat[:-1]) | (owner[1:] != owner[:-1])
        return owner[first], np.searchsorted(flat[first], np.arange(257))

    @functools.cached_property
    def sorted_tokens(self) -> tuple[list[bytes], np.ndarray, dict[bytes, int]]:
        """The non-empty tokens' bytes in sorted order, their ids (int32), and where each distinct byte
        string first appears in that order: tokens that start with some bytes are a contiguous range
        (literal_tokens.py)."""
        ids = sorted((i for i, b in enumerate(self.token_bytes) if b), key=self.token_bytes.__getitem__)
        data = [self.token_bytes[i] for i in ids]
        first: dict[bytes, int] = {}
        for n, b in enumerate(data):
            first.setdefault(b, n)
        return data, np.asarray(ids, dtype=np.int32), first


_vocabs: "weakref.WeakKeyDictionary[object, dict[tuple[int, ...], TokenVocab]]" = weakref.WeakKeyDictionary()
_vocabs_lock = threading.Lock()  # front ends build constraints from several threads


def vocab_of(tokenizer, eos_token_ids: tuple[int, ...] | list[int] | None = None) -> TokenVocab:
    """The TokenVocab of `tokenizer` (EOS ids default to the tokenizer's eos_token_id), cached per tokenizer."""
    if eos_token_ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError("the tokenizer has no eos_token_id; pass eos_token_ids")
        eos_token_ids = (eos,)
    eos_ids = tuple(sorted({int(i) for i in eos_token_ids}))
    with _vocabs_lock:
        per_tokenizer = _vocabs.setdefault(tokenizer, {})
        found = per_tokenizer.get(eos_ids)
        if found is None:
            token_bytes, special = token_bytes_of(tokenizer)
            digest = hashlib.sha256()
            for b in token_bytes:
                digest.update(len(b).to_bytes(4, "little"))
                digest.update(b)
            digest.update(repr(eos_ids).encode())
            found = per_tokenizer[eos_ids] = TokenVocab(token_bytes, frozenset(special), eos_ids, digest.hexdigest())
    return found


_spellable: dict[str, np.ndarray] = {}


def spellable_bytes(vocab: TokenVocab) -> np.ndarray:
    """bool [256]: the bytes some token of `vocab` contains (cached per vocabulary)."""
    found = _spellable.get(vocab.fingerprint)
    if found is None:
        found = np.zeros(256, dtype=bool)
        found[np.unique(np.frombuffer(b"".join(vocab.token_bytes), dtype=np.uint8))] = True
        _spellable[vocab.fingerprint] = found
    return found
