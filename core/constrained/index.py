"""The token index: for every DFA state, the tokens allowed next and the state each leads to.

Built for one (pattern, vocabulary) pair by walking the whole vocabulary trie through the DFA from every
state at once, one trie level (byte position) per numpy step; a (state, trie node) pair survives while
the DFA has a transition for the node's byte, and a token is allowed from a state when its node is
reached. No Python loop runs over the vocabulary. Cached in memory (LRU) and on disk, keyed by a hash
of the pattern and the vocabulary.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from radixlm.core.cache import cache_dir
from radixlm.core.constrained.compressed_fsm import CompressedFSM
from radixlm.core.constrained.masks import MaskCache
from radixlm.core.constrained.regex_dfa import ByteDFA, regex_to_dfa
from radixlm.core.constrained.vocab import TokenTrie, TokenVocab

logger = logging.getLogger("radixlm")

_FORMAT_VERSION = "radixlm-token-index-v2"
MEMORY_CACHE_SIZE = 64
MASK_CACHE_SIZE = 512  # per index; a mask of a 151k vocabulary is 151 KB as bool, 19 KB packed


def expand_ranges(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ranges [starts[i], starts[i] + counts[i]): (owner i of each element, the element)."""
    owner = np.repeat(np.arange(len(starts)), counts)
    return owner, np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))


class TokenIndex:
    """The tokens allowed from each DFA state (EOS aside: it is allowed exactly in accepting states).

    Two layouts, chosen per state by how much of the vocabulary it allows: a sorted id list (CSR:
    tokens[state_ptr[s]:state_ptr[s+1]]) for narrow states, a packed bit row for wide ones (inside a
    string most of the vocabulary is allowed). The state after a token is found by walking its bytes
    through the DFA (a few steps), so it is not stored."""

    def __init__(self, dfa: ByteDFA, token_bytes: list[bytes], eos_ids: np.ndarray, state_ptr: np.ndarray,
                 tokens: np.ndarray, dense_row: np.ndarray, dense_bits: np.ndarray) -> None:
        self.dfa = dfa
        self.token_bytes = token_bytes
        self.vocab_size = len(token_bytes)
        self.eos_ids = eos_ids
        self.state_ptr = state_ptr
        self.tokens = tokens
        self.dense_row = dense_row  # int32 [num_states]: row of dense_bits, or -1 for a CSR state
        self.dense_bits = dense_bits  # uint8 [num_dense, 4 * ceil(vocab_size / 32)], little bit order
        self.fsm = CompressedFSM(dfa)
        self._eos_set = frozenset(int(i) for i in eos_ids)
        self._accepting = dfa.accepting.tolist()
        self._ptr = state_ptr.tolist()
        self._row = dense_row.tolist()
        self._masks = MaskCache(MASK_CACHE_SIZE)
        # Per visited state, Python-level views for the per-token hot path (advance): the allowed set
        # (bytes of the packed bit row, or a frozenset of ids) and the DFA row as a list.
        self._allowed: dict[int, bytes | frozenset[int]] = {}
        self._trans_rows: dict[int, list[int]] = {}

    @property
    def num_states(self) -> int:
        return self.dfa.num_states

    def is_eos(self, token_id: int) -> bool:
        return token_id in self._eos_set

    def is_accepting(self, state: int) -> bool:
        return self._accepting[state]

    def is_terminal(self, state: int) -> bool:
        """Accepting with no token allowed: only the end of the output can follow."""
        return self._accepting[state] and self._row[state] < 0 and self._ptr[state] == self._ptr[state + 1]

    def edge(self, state: int) -> tuple[bytes, int]:
        """(forced bytes from `state`, the state after them); see CompressedFSM.edge."""
        return self.fsm.edge(state)

    def forced_text(self, state: int) -> str | None:
        return self.fsm.forced_text(state)

    def byte_successors(self, state: int) -> list[int]:
        """The state after each byte from `state` (-1: the byte is not allowed)."""
        return self.dfa.transitions[state].tolist()

    def allowed_tokens(self, state: int) -> np.ndarray:
        """Sorted ids of the tokens allowed from `state`, EOS excluded."""
        row = self._row[state]
        if row < 0:
            return self.tokens[self._ptr[state]:self._ptr[state + 1]]
        bits = np.unpackbits(self.dense_bits[row], bitorder="little", count=self.vocab_size)
        return np.flatnonzero(bits).astype(np.int32)

    def is_allowed(self, state: int, token_id: int) -> bool:
        """Whether `token_id` (not EOS) may follow in `state`."""
        allowed = self._allowed.get(state)
        if allowed is None:
            row = self._row[state]
            if row >= 0:
                allowed = self.dense_bits[row].tobytes()
            else:
                allowed = frozenset(self.tokens[self._ptr[state]:self._ptr[state + 1]].tolist())
            self._allowed[state] = allowed
        if isinstance(allowed, bytes):
            return 0 <= token_id < self.vocab_size and bool(allowed[token_id >> 3] >> (token_id & 7) & 1)
        return token_id in allowed

    def next_state(self, state: int, token_id: int) -> int:
        """The state after `token_id` from `state`, or -1 if it is not allowed there (EOS included)."""
        if not self.is_allowed(state, token_id):
            return -1
        rows = self._trans_rows
        for b in self.token_bytes[token_id]:
            row = rows.get(state)
            if row is None:
                row = rows[state] = self.dfa.transitions[state].tolist()
            state = row[b]
        return state

    def mask(self, state: int, vocab_size: int, packed: bool = False) -> torch.Tensor:
        """Allowed next tokens of `state` over `vocab_size` ids (the model's logits width), cached: see
        MaskCache. The tensor is shared between requests: never write to it."""
        return self._masks.get(state, vocab_size, packed, lambda width: self._allowed_bits(state, width))

    def _allowed_bits(self, state: int, vocab_size: int) -> np.ndarray:
        words = -(-vocab_size // 32)
        row = self._row[state]
        if row >= 0:
            bits = np.zeros(words * 4, dtype=np.uint8)
            width = min(len(bits), self.dense_bits.shape[1])
            bits[:width] = self.dense_bits[row, :width]
            allowed = np.unpackbits(bits, bitorder="little")
            allowed[vocab_size:] = 0
        else:
            allowed = np.zeros(words * 32, dtype=np.uint8)
            toks = self.allowed_tokens(state)
            allowed[toks[toks < vocab_size]] = 1
        if self._accepting[state]:
            allowed[self.eos_ids[self.eos_ids < vocab_size]] = 1
        return np.packbits(allowed, bitorder="little")

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {"transitions": self.dfa.transitions, "accepting": self.dfa.accepting, "eos_ids": self.eos_ids,
                "state_ptr": self.state_ptr, "tokens": self.tokens, "dense_row": self.dense_row,
                "dense_bits": self.dense_bits}

    @classmethod
    def from_arrays(cls, a, token_bytes: list[bytes]) -> "TokenIndex":
        dfa = ByteDFA(transitions=a["transitions"], accepting=a["accepting"])
        return cls(dfa, token_bytes, a["eos_ids"], a["state_ptr"], a["tokens"], a["dense_row"], a["dense_bits"])


DENSE_FRACTION = 1 / 64  # a state is walked densely when its first bytes lead to this share of the trie
DENSE_CHUNK = 32  # dense states walked together


def _sparse_walk(dfa: ByteDFA, trie: TokenTrie, states: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start state, token, end state) for every token allowed from `states`, following only the
    (state, trie node) pairs still alive: cheap when a state allows little of the vocabulary."""
    trans = dfa.transitions
    start, cur = states.astype(np.int32), states.astype(np.int32)
    node = np.zeros(len(states), dtype=np.int64)
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for d in range(1, trie.depth + 1):
        if not len(cur):
            break
        ptr = trie.child_ptr[d]
        pair, child = expand_ranges(ptr[node], ptr[node + 1] - ptr[node])
        nxt = trans[cur[pair], trie.byte[d][child]]
        keep = nxt >= 0
        start, cur, node = start[pair[keep]], nxt[keep], child[keep]
        eptr = trie.end_ptr[d]
        owner, idx = expand_ranges(eptr[node], eptr[node + 1] - eptr[node])
        if len(idx):
            found.append((start[owner], trie.end_tokens[d][idx], cur[owner]))
    if not found:
        return np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32)
    return tuple(np.concatenate(parts) for parts in zip(*found))


def _dense_walk(trans_by_byte: np.ndarray, stuck_ext: np.ndarray, trie: TokenTrie, states: np.ndarray,
                vocab_size: int) -> np.ndarray:
    """bool [vocab_size, len(states)]: which tokens each of `states` allows (ending in a stuck state
    does not count). Walks all the states over whole trie levels at once; `trans_by_byte[b * stride + s]`
    is the DFA with a dead state (the last, stride - 1) in place of -1; nodes no state is alive in are
    dropped.
    Node-major arrays, so that gathering nodes moves contiguous rows."""
    stride = len(stuck_ext)
    dead = stride - 1
    out = np.zeros((vocab_size, len(states)), dtype=bool)
    cur = states.astype(trans_by_byte.dtype)[None, :]
    cols = np.zeros(1, dtype=np.int64)  # alive nodes of the previous level (the root)
    for d in range(1, trie.depth + 1):
        ptr = trie.child_ptr[d]
        parent, child = expand_ranges(ptr[cols], ptr[cols + 1] - ptr[cols])
        nxt = np.take(trans_by_byte, cur[parent] + (trie.byte[d][child].astype(np.int32) * stride)[:, None])
        alive = np.flatnonzero((nxt != dead).any(axis=1))
        cur, cols = nxt[alive], child[alive]
        if not len(cols):
            break
        eptr = trie.end_ptr[d]
        owner, idx = expand_ranges(eptr[cols], eptr[cols + 1] - eptr[cols])
        if len(idx):
            out[trie.end_tokens[d][idx]] = ~stuck_ext[cur[owner]]
    return out


def build_index(dfa: ByteDFA, vocab: TokenVocab, pattern: str = "") -> TokenIndex:
    """Walks every token through the DFA from every state, level by level of the vocabulary trie."""
    trie, n_states, vocab_size = vocab.trie, dfa.num_states, vocab.size
    trans = dfa.transitions
    reach = (trans >= 0).astype(np.int64) @ trie.first_byte_weight  # trie nodes under the allowed first bytes
    dense_states = np.flatnonzero(reach > DENSE_FRACTION * trie.num_nodes).astype(np.int32)
    sparse_states = np.flatnonzero(reach <= DENSE_FRACTION * trie.num_nodes).astype(np.int32)
    src, tok, dst = _sparse_walk(dfa, trie, sparse_states)

    # A state no token leaves and that does not accept is a dead end for generation (the vocabulary
    # cannot spell what it needs next): drop the tokens that lead into it, until none is left. Dense
    # states allow much of the vocabulary, so they are never such dead ends.
    is_dense = np.zeros(n_states, dtype=bool)
    is_dense[dense_states] = True
    while True:
        stuck = (np.bincount(src, minlength=n_states) == 0) & ~dfa.accepting & ~is_dense
        into_stuck = stuck[dst]
        if not into_stuck.any():
            break
        src, tok, dst = src[~into_stuck], tok[~into_stuck], dst[~into_stuck]
    if stuck[0]:
        raise ValueError(f"no sequence of this tokenizer's tokens matches the pattern {pattern!r}")

    order = np.argsort(src.astype(np.int64) * vocab_size + tok, kind="stable")
    state_ptr = np.searchsorted(src[order], np.arange(n_states + 1)).astype(np.int64)

    words = -(-vocab_size // 32)
    dense_bits = np.zeros((len(dense_states), words * 4), dtype=np.uint8)
    small = np.int16 if n_states < 2**15 - 1 else np.int32  # halves the memory traffic of the walk
    trans_by_byte = np.vstack([np.where(trans >= 0, trans, n_states), np.full((1, 256), n_states)]).astype(small).T.ravel()
    stuck_ext = np.append(stuck, True)
    for lo in range(0, len(dense_states), DENSE_CHUNK):
        chunk = dense_states[lo:lo + DENSE_CHUNK]
        allowed = _dense_walk(trans_by_byte, stuck_ext, trie, chunk, vocab_size)
        if not allowed.any(axis=0).all():
            raise ValueError(f"the tokenizer cannot continue the pattern {pattern!r} from some state")
        packed = np.packbits(allowed.T, axis=1, bitorder="little")
        dense_bits[lo:lo + len(chunk), :packed.shape[1]] = packed
    dense_row = np.full(n_states, -1, dtype=np.int32)
    dense_row[dense_states] = np.arange(len(dense_states), dtype=np.int32)
    return TokenIndex(dfa, vocab.token_bytes, np.asarray(vocab.eos_ids, dtype=np.int64), state_ptr,
                      tok[order].astype(np.int32), dense_row, dense_bits)


_memory: OrderedDict[tuple[str, str], TokenIndex] = OrderedDict()
_memory_lock = threading.Lock()


def get_index(pattern: str, vocab: TokenVocab) -> TokenIndex:
    """The token index of (pattern, vocab): from memory, else from disk, else built (and saved)."""
    key = (pattern, vocab.fingerprint)
    with _memory_lock:
        found = _memory.get(key)
        if found is not None:
            _memory.move_to_end(key)
            return found
    digest = hashlib.sha256(f"{_FORMAT_VERSION}\0{vocab.fingerprint}\0{pattern}".encode()).hexdigest()
    path = cache_dir() / "constrained" / f"{digest}.npz"
    index = _load(path, vocab.token_bytes)
    if index is None:
        index = build_index(regex_to_dfa(pattern), vocab, pattern)
        _save(index, path)
    with _memory_lock:
        _memory[key] = index
        if len(_memory) > MEMORY_CACHE_SIZE:
            _memory.popitem(last=False)
    return index


def clear_memory_cache() -> None:
    """Forgets the indexes held in memory (the disk cache stays)."""
    with _memory_lock:
        _memory.clear()


def _load(path: Path, token_bytes: list[bytes]) -> TokenIndex | None:
    if not path.exists():
        return None
    try:
        with np.load(path) as arrays:
            return TokenIndex.from_arrays({k: arrays[k] for k in arrays.files}, token_bytes)
    except Exception as e:  # a truncated or foreign file: rebuild it
        logger.warning("ignoring unreadable token index cache %s: %s", path, e)
        return None


def _save(index: TokenIndex, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp.npz")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **index.to_arrays())
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache is not an error
        logger.warning("could not save token index cache %s: %s", path, e)
