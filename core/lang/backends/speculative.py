"""API speculative execution (SGLang paper §5).

An API model cannot keep KV state between calls, so a program with several gens pays one call, and
the whole prompt again, per gen. With `@function(num_api_spec_tokens=N)` the first gen of a chain
asks for at least N tokens and ignores its stop strings; the program's following constant text and
gens are then matched against that speculated output: a constant must appear verbatim, a gen takes
the text up to its stop string. Where matching fails, the rest is generated with normal calls, so a
program's meaning never depends on the speculation.

Completion models: matching happens as the program runs (`CompletionSpeculation`).
Chat models: an assistant turn is one message, so its pieces are collected until the turn ends and
then filled from one call (`speculate_turn`).

The speculative call asks for token logprobs, whose token texts give the token boundaries of the
speculated text; a gen served from it is then cut after its own max_tokens tokens, as a normal call
would be. (Where the API returns no usable token texts, a gen simply ends at its stop string.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixlm.core.lang.ir import GenParams

if TYPE_CHECKING:
    from radixlm.core.lang.backends.base import StreamState


@dataclass
class TurnItem:
    """A piece of a speculated chat turn: constant text, or a gen (name and resolved params)."""

    text: str | None = None
    name: Any = None
    params: GenParams | None = None

    @property
    def is_text(self) -> bool:
        return self.params is None


def _sampling_key(params: GenParams) -> tuple:
    """What must agree between the speculative call and a gen served from it."""
    return (params.temperature, params.top_p, params.top_k, params.min_p, params.frequency_penalty,
            params.presence_penalty, params.ignore_eos)


def _speculable(params: GenParams) -> bool:
    """A gen can be cut out of speculated text only if it ends at a stop string and has no
    constraint or minimum length that the cut could not honour."""
    return bool(params.stop_list()) and not params.constraint()[0] and not params.min_new_tokens


def cut_at_stop(text: str, stops: list[str], complete: bool) -> str | None:
    """The gen's value from speculated text: up to its earliest stop string; all of it if the model
    ended there (complete); None if the speculation does not reach the gen's end."""
    positions = [p for p in (text.find(s) for s in stops) if p >= 0]
    if positions:
        return text[:min(positions)]
    return text if complete else None


def token_ends(text: str, meta: dict[str, Any]) -> list[int] | None:
    """Character offsets in `text` where its tokens end, from the call's token logprobs; None when
    the API gave none or its token texts do not spell `text` (byte pieces of a character). Tokens
    after the text (an end-of-text token, which the text leaves out) are ignored."""
    tokens = [entry[2] for entry in meta.get("output_token_logprobs") or []]
    ends, end = [], 0
    for token in tokens:
        if end == len(text):
            break
        end += len(token)
        ends.append(end)
    return ends if ends and "".join(tokens[:len(ends)]) == text else None


def cap_tokens(text: str, value: str, ends: list[int] | None, max_tokens: int | None) -> str:
    """`value`, a prefix of `text` (whose tokens end at `ends`), as a normal call limited to
    max_tokens would return it: a call needs the tokens inside the value, plus the one that starts
    the stop string when the value ends before the text does."""
    if ends is None or not max_tokens:
        return value
    inside = [e for e in ends if 0 < e <= len(value)]
    needed = len(inside) + (1 if len(value) < len(text) else 0)
    return text[:inside[max_tokens - 1]] if needed > max_tokens else value


def _finished_by_itself(meta: dict[str, Any]) -> bool:
    reason = meta.get("finish_reason")
    if isinstance(reason, dict):
        reason = reason.get("type")
    return reason is not None and reason != "length"


class CompletionSpeculation:
    """Speculated text of a completion-model stream, consumed as the program appends to it."""

    def __init__(self) -> None:
        self.text: str | None = None  # what the model is expected to write next; None: nothing
        self.ends: list[int] | None = None  # where its tokens end (character offsets), if known
        self.complete = False  # the model ended the speculated text itself (EOS)
        self.key: tuple | None = None

    def consume_text(self, value: str) -> None:
        """The program appended `value`: keep matching if the model predicted it, else drop."""
        if self.text is None:
            return
        if self.text.startswith(value):
            self.text = self.text[len(value):]
            if self.ends is not None:
                self.ends = [e - len(value) for e in self.ends if e > len(value)]
        else:
            self.text = None

    def generate(self, executor: "StreamState", params: GenParams) -> tuple[str, dict[str, Any]]:
        """The gen's text, from speculated text when it matches, else from a (speculative) call.
        The speculated text is consumed when the interpreter appends the returned text."""
        backend = executor.backend
        if not _speculable(params):
            self.text = None
            return backend.generate(executor, params)
        fresh_meta = None
        if self.text is None or self.key != _sampling_key(params):
            n = executor.num_api_spec_tokens or 0
            spec_params = dataclasses.replace(params, max_new_tokens=max(params.max_new_tokens or 0, n),
                                              stop=[], stop_token_ids=[], return_logprob=True)
            self.text, fresh_meta = backend.generate(executor, spec_params)
            self.ends = token_ends(self.text, fresh_meta)
            self.key = _sampling_key(params)
            self.complete = _finished_by_itself(fresh_meta)
        value = cut_at_stop(self.text, params.stop_list(), self.complete)
        if value is None and fresh_meta is not None and (params.max_new_tokens or 0) >= (executor.num_api_spec_tokens or 0):
            value = self.text  # the call was exactly this gen's own call: it ended at max_tokens
        if value is None:
            self.text = None
            return backend.generate(executor, params)
        value = cap_tokens(self.text, value, self.ends, params.max_new_tokens)
        return value, {"finish_reason": (fresh_meta or {}).get("finish_reason"), "speculative": True}


def match_turn(items: list[TurnItem], output: str, complete: bool, key: tuple,
               ends: list[int] | None = None) -> list[str | None]:
    """Per item, its value taken from the speculated turn `output` (whose tokens end at `ends`),
    up to the first piece that does not match (None from there on)."""
    values: list[str | None] = [None] * len(items)
    done = 0  # characters of output matched so far
    for i, item in enumerate(items):
        rest = output[done:]
        if item.is_text:
            if not rest.startswith(item.text):
                break
            values[i], done = item.text, done + len(item.text)
            continue
        if item.params.constraint()[0] or item.params.min_new_tokens or _sampling_key(item.params) != key:
            break
        value = cut_at_stop(rest, item.params.stop_list(), complete)
        if value is None:
            break
        local_ends = None if ends is None else [e - done for e in ends if e > done]
        value = cap_tokens(rest, value, local_ends, item.params.max_new_tokens)
        values[i], done = value, done + len(value)
    return values


def speculate_turn(executor: "StreamState", items: list[TurnItem]) -> list[str | None]:
    """One chat call for a whole assistant turn, matched against the turn's pieces."""
    gens = [item for item in items if not item.is_text]
    if not gens:
        return [None] * len(items)
    spec_params = dataclasses.replace(gens[0].params, max_new_tokens=executor.num_api_spec_tokens,
                                      stop=[], stop_token_ids=[], return_logprob=True)
    output, meta = executor.backend.generate(executor, spec_params)
    return match_turn(items, output, _finished_by_itself(meta), _sampling_key(gens[0].params),
                      token_ends(output, meta))
