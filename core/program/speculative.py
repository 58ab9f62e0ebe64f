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

A gen served from speculated text ends at its stop string; its own max_tokens is not re-checked
(that would need the API model's tokenizer).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixlm.core.program.ir import GenParams

if TYPE_CHECKING:
    from radixlm.core.program.interpreter import StreamExecutor


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


def _finished_by_itself(meta: dict[str, Any]) -> bool:
    reason = meta.get("finish_reason")
    if isinstance(reason, dict):
        reason = reason.get("type")
    return reason is not None and reason != "length"


class CompletionSpeculation:
    """Speculated text of a completion-model stream, consumed as the program appends to it."""

    def __init__(self) -> None:
        self.text: str | None = None  # what the model is expected to write next; None: nothing
        self.complete = False  # the model ended the speculated text itself (EOS)
        self.key: tuple | None = None

    def consume_text(self, value: str) -> None:
        """The program appended `value`: keep matching if the model predicted it, else drop."""
        if self.text is None:
            return
        if self.text.startswith(value):
            self.text = self.text[len(value):]
        else:
            self.text = None

    def generate(self, executor: "StreamExecutor", params: GenParams) -> tuple[str, dict[str, Any]]:
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
                                              stop=[], stop_token_ids=[])
            self.text, fresh_meta = backend.generate(executor, spec_params)
            self.key = _sampling_key(params)
            self.complete = _finished_by_itself(fresh_meta)
        value = cut_at_stop(self.text, params.stop_list(), self.complete)
        if value is None and fresh_meta is not None and (params.max_new_tokens or 0) >= (executor.num_api_spec_tokens or 0):
            value = self.text  # the call was exactly this gen's own call: it ended at max_tokens
        if value is None:
            self.text = None
            return backend.generate(executor, params)
        return value, {**(fresh_meta or {}), "speculative": True}


def match_turn(items: list[TurnItem], output: str, complete: bool, key: tuple) -> list[str | None]:
    """Per item, its value taken from the speculated turn `output`, up to the first piece that does
    not match (None from there on)."""
    values: list[str | None] = [None] * len(items)
    rest = output
    for i, item in enumerate(items):
        if item.is_text:
            if not rest.startswith(item.text):
                break
            values[i], rest = item.text, rest[len(item.text):]
            continue
        if item.params.constraint()[0] or item.params.min_new_tokens or _sampling_key(item.params) != key:
            break
        value = cut_at_stop(rest, item.params.stop_list(), complete)
        if value is None:
            break
        values[i], rest = value, rest[len(value):]
    return values


def speculate_turn(executor: "StreamExecutor", items: list[TurnItem]) -> list[str | None]:
    """One chat call for a whole assistant turn, matched against the turn's pieces."""
    gens = [item for item in items if not item.is_text]
    if not gens:
        return [None] * len(items)
    spec_params = dataclasses.replace(gens[0].params, max_new_tokens=executor.num_api_spec_tokens,
                                      stop=[], stop_token_ids=[])
    output, meta = executor.backend.generate(executor, spec_params)
    return match_turn(items, output, _finished_by_itself(meta), _sampling_key(gens[0].params))
