"""The per-request constraint (core.runtime.constraint.TokenConstraint) and the factory the engine calls."""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

from radixlm.core.runtime.constrained.accept_paths import can_finish
from radixlm.core.runtime.constrained.automata.grammar_compiler import DEFAULT_BUDGET, GrammarBudget
from radixlm.core.runtime.constrained.grammar_index_cache import get_grammar_index
from radixlm.core.runtime.constrained.pda import GrammarIndex
from radixlm.core.runtime.constrained.tokens.vocab import vocab_of
from radixlm.core.runtime.tokenizer.fast_path import encoder_for

if TYPE_CHECKING:
    from radixlm.core.runtime.constrained.llguidance_backend import LLGuidanceConstraint

KINDS = ("regex", "json_schema", "choices")


class GrammarConstraint:
    """Follows one request's output through a grammar index (pda.py): the configuration after the tokens
    fed so far."""

    def __init__(self, index: GrammarIndex) -> None:
        self.index = index
        self._token_bytes = index.token_bytes
        self.state = 0
        self._finished = False  # EOS was fed
        self._states = [0]  # the state before the first token and after each one fed since

    def allowed_token_mask(self, vocab_size: int, packed: bool = False) -> torch.Tensor:
        """bool [vocab_size] (or packed int32 words, see GrammarIndex.mask); EOS only where accepting.
        Shared and cached per state: read it, never write to it."""
        return self.index.mask(self.state, vocab_size, packed)

    def advance(self, token_id: int) -> None:
        if self._finished:
            raise ValueError("the constraint is finished; no token may follow")
        if self.index.is_eos(token_id):
            if not self.index.is_accepting(self.state):
                raise ValueError(f"EOS token {token_id} is not allowed before the output matches")
            self._finished = True
            return
        nxt = self.index.next_state(self.state, token_id)
        if nxt < 0:
            raise ValueError(f"token {token_id} ({self._token_bytes[token_id]!r}) is not allowed here")
        self.state = nxt
        self._states.append(nxt)

    def is_finished(self) -> bool:
        return self._finished or self.index.is_terminal(self.state)

    def fork(self) -> "GrammarConstraint":
        twin = GrammarConstraint(self.index)
        twin.state, twin._finished, twin._states = self.state, self._finished, list(self._states)
        return twin

    def forced_text(self) -> str | None:
        if self.is_finished():
            return None
        return self.index.forced_text(self.state)

    def jump_forward(self, output_ids: list[int], tokenizer: Any, max_replace: int = 1,
                     max_new_tokens: int | None = None) -> tuple[int, list[int]] | None:
        """Plans and takes a jump-forward: when the pattern forces text next, returns (k, tokens) meaning
        "replace the last k output tokens by `tokens`", and moves the constraint past `tokens`.

        The forced text is tokenized together with the last output tokens that form whole characters
        (at most `max_replace` of them: those the caller can still change), so that tokens merging
        across the boundary come out as the tokenizer's canonical ones. Trailing tokens that could merge
        with what the model writes next (the last pre-tokenizer piece) are held back, unless the pattern
        ends after the forced text. The output grows by at most `max_new_tokens` tokens. None when there
        is nothing to jump, or the tokenizer does not spell the text back byte for byte."""
        forced = self.forced_text()
        if not forced or (max_new_tokens is not None and max_new_tokens <= 0):
            return None
        tb = self._token_bytes
        k, tail = 0, b""
        for n in range(1, min(max_replace, len(output_ids), len(self._states) - 1) + 1):
            candidate = b"".join(tb[t] for t in output_ids[-n:])
            if _is_whole_characters(candidate):
                k, tail = n, candidate
                break
        text = tail.decode() + forced
        full, boundary = _tokenized(tokenizer, text)
        if any(not 0 <= t < len(tb) for t in full) or b"".join(tb[t] for t in full) != text.encode():
            return None  # a normalizer changed the text, or a tokenizer without byte tokens lost some
        same = 0  # leading re-tokenized tokens equal to the ones already there need no replacing
        while same < min(k, len(full)) and full[same] == output_ids[len(output_ids) - k + same]:
            same += 1
        k, new = k - same, full[same:]
        edge, end = self.index.edge(self.state)
        if not (edge == forced.encode() and self.index.is_terminal(end)):
            offset = sum(len(tb[t]) for t in full[:same])
            new = new[:_stable_prefix_len([tb[t] for t in new], offset, boundary)]
        if max_new_tokens is not None:
            new = new[: max_new_tokens + k]
        replaced = sum(len(tb[t]) for t in output_ids[len(output_ids) - k:]) if k else 0
        if sum(len(tb[t]) for t in new) <= replaced:
            return None  # nothing beyond the replaced tokens survives the hold-back
        state = self._states[-1 - k]
        for t in new:
            state = self.index.next_state(state, t)
            if state < 0:
                return None
        del self._states[len(self._states) - k:]
        self.state = self._states[-1]
        for t in new:
            self.advance(t)
        return k, new


def _is_whole_characters(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def _tokenized(tokenizer: Any, text: str) -> tuple[list[int], int | None]:
    """The canonical tokens of `text`, and the byte offset where its last pre-tokenizer piece starts (None
    without a pre-tokenizer), cached per tokenizer: the same forced strings (keys, punctuation) come back
    in every request of a schema, and tokenizing them was most of a jump's host time."""
    try:
        cached = _TOKENIZED[tokenizer]
    except KeyError:
        ref = weakref.ref(tokenizer)  # the cache must not keep its tokenizer alive
        cached = _TOKENIZED[tokenizer] = functools.lru_cache(maxsize=8192)(lambda t: _tokenize(ref(), t))
    except TypeError:  # not weakly referenceable: uncached
        return _tokenize(tokenizer, text)
    full, boundary = cached(text)
    return list(full), boundary


_TOKENIZED: "weakref.WeakKeyDictionary[Any, Callable[[str], tuple[tuple[int, ...], int | None]]]" = (
    weakref.WeakKeyDictionary())


def _tokenize(tokenizer: Any, text: str) -> tuple[tuple[int, ...], int | None]:
    pre = getattr(getattr(tokenizer, "backend_tokenizer", tokenizer), "pre_tokenizer", None)
    boundary = None
    if pre is not None:
        splits = pre.pre_tokenize_str(text)
        boundary = len(text[: splits[-1][1][0]].encode()) if splits else 0
    return tuple(encoder_for(tokenizer)(text)), boundary


def _stable_prefix_len(pieces: list[bytes], offset: int, boundary: int | None) -> int:
    """How many of the tokens `pieces` (which spell the text from byte `offset`) lie before the text's last
    pre-tokenizer piece (starting at byte `boundary`): the ones no following text can change. Without a
    pre-tokenizer, all but the last."""
    if boundary is None:
        return len(pieces) - 1
    count, pos = 0, offset
    for piece in pieces:
        pos += len(piece)
        if pos > boundary:
            break
        count += 1
    return count


BACKENDS = ("radixlm", "llguidance")
REACH_CHECK_STATES = 2_000  # configurations a build may explore to find that some output can be written


def build_constraint(kind: str, spec: Any, tokenizer: object, *, eos_token_ids: list[int] | None = None,
                     whitespace_pattern: str | None = None, backend: str = "radixlm",
                     budget: GrammarBudget = DEFAULT_BUDGET) -> GrammarConstraint | LLGuidanceConstraint:
    """A fresh constraint for one request. kind: 'regex' (a Python regex, fullmatch semantics),
    'json_schema' (a JSON string, dict or pydantic model class) or 'choices' (a list of strings).
    EOS ids default to the tokenizer's eos_token_id. Invalid input raises ValueError naming the problem,
    GrammarBudgetError past a budget. backend: 'radixlm' (the grammar engine, pda.py) or 'llguidance' (the
    optional PyPI package)."""
    vocab = vocab_of(tokenizer, eos_token_ids)
    if backend == "radixlm":
        index = get_grammar_index(kind, spec, vocab, whitespace_pattern, budget)
        if not index.spells_every_byte and not can_finish(index, index.start, REACH_CHECK_STATES):
            # No output can be written with the bytes this vocabulary's tokens contain. (With every byte
            # in some token, the compiler's pruning of rules that cannot finish already guarantees one.)
            raise ValueError(f"no sequence of this tokenizer's tokens matches the {kind} {spec!r}")
        return GrammarConstraint(index)
    if backend == "llguidance":
        from radixlm.core.runtime.constrained.llguidance_backend import build_llguidance_constraint

        return build_llguidance_constraint(kind, spec, tokenizer, vocab, whitespace_pattern)
    raise ValueError(f"unknown grammar backend {backend!r}; expected one of {BACKENDS}")
