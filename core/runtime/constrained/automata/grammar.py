"""The grammar IR: a context-free grammar whose terminals are small byte-level regular languages.

A `Grammar` maps rule names to expressions built from `Terminal` (a Python regex, or a ready ByteDFA),
`Ref` (another rule, recursion allowed), `Seq`, `Alt` and `Repeat`. JSON schemas, regexes and choice
lists all become grammars (json_grammar.py, `regex_grammar`, `choices_grammar`); grammar_compiler.py
compiles one, pda.py runs it. Left recursion is not supported (the compiler refuses it).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Union

from radixlm.core.runtime.constrained.automata.regex_dfa import ByteDFA, literal_dfa


@dataclass(frozen=True)
class Terminal:
    """A regular language over bytes: `regex` (Python syntax, fullmatch), or `dfa` built elsewhere, then
    `key` names it (terminals with equal keys are one terminal)."""

    regex: str | None = None
    key: str | None = None
    dfa: ByteDFA | None = field(default=None, compare=False, hash=False, repr=False)

    @property
    def ident(self) -> str:
        return self.key if self.key is not None else f"re:{self.regex}"


@dataclass(frozen=True)
class Ref:
    rule: str


@dataclass(frozen=True)
class Seq:
    items: tuple["Expr", ...]


@dataclass(frozen=True)
class Alt:
    items: tuple["Expr", ...]


@dataclass(frozen=True)
class Repeat:
    item: "Expr"
    lo: int = 0
    hi: int | None = None  # None: unbounded


Expr = Union[Terminal, Ref, Seq, Alt, Repeat]
EMPTY = Seq(())


@dataclass
class Grammar:
    rules: dict[str, Expr]
    start: str

    def __post_init__(self) -> None:
        if self.start not in self.rules:
            raise ValueError(f"the start rule {self.start!r} is not defined")


# Each entry is two objects that every full collection walks (after a corpus run, 4,096 entries were 1.3-4.9 ms
# of a full collection's 1.9-6.2): 1,024 keep 98.7 % of that run's hits, as most hits are a schema writing its
# own keys and punctuation again.
@functools.lru_cache(maxsize=1024)
def lit(text: str) -> Terminal:
    """A terminal matching exactly `text` (its DFA built directly: keys and punctuation are many; cached,
    as a schema writes its punctuation and keys thousands of times)."""
    return Terminal(regex=re.escape(text), dfa=literal_dfa(text.encode()))


def seq(*items: Expr) -> Expr:
    flat: list[Expr] = []
    for item in items:
        flat.extend(item.items if isinstance(item, Seq) else (item,))
    return flat[0] if len(flat) == 1 else Seq(tuple(flat))


def alt(*items: Expr) -> Expr:
    unique = list(dict.fromkeys(items))
    return unique[0] if len(unique) == 1 else Alt(tuple(unique))


def opt(item: Expr) -> Expr:
    return Repeat(item, 0, 1)


def regex_grammar(pattern: str) -> Grammar:
    """The one-rule grammar of a Python regex (fullmatch semantics)."""
    if not isinstance(pattern, str):
        raise ValueError(f"regex must be a string, got {type(pattern).__name__}")
    return Grammar({"start": Terminal(regex=pattern)}, "start")


def choices_grammar(choices: list[str]) -> Grammar:
    """The one-rule grammar of a list of literal strings."""
    if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("choices must be a non-empty list of strings")
    return Grammar({"start": Terminal(regex="|".join(re.escape(c) for c in choices))}, "start")
