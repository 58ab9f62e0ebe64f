"""The program IR: the expressions a program appends to its state (`s += ...`) and the generation
parameters they carry.

An expression is text (`Constant`), a model call (`Gen`, `Select`), chat structure (`RoleBegin`,
`RoleEnd`), an image, a reference to another state's variable (`Variable`), a variable scope, or
fork/join structure. `a + b` of expressions (or of an expression and a str) is an `ExprList`.
The interpreter executes expressions; the tracer records them as a graph (`prev_node` links each
node to the one before it in its stream).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixlm.core.lang.errors import TracingError

if TYPE_CHECKING:
    from radixlm.core.lang.choices import ChoicesSamplingMethod

# Regular expressions behind gen(dtype=...). int and float allow trailing blanks, and their gens stop
# at a blank, so a model ends the number by writing one (the blank itself is not kept).
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

_DTYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str",
                "int": "int", "float": "float", "bool": "bool", "str": "str", "string": "str"}
_DTYPE_REGEX = {"int": REGEX_INT, "float": REGEX_FLOAT, "bool": REGEX_BOOL, "str": REGEX_STR}


def dtype_name(dtype: Any) -> str:
    """'int', 'float', 'bool' or 'str' for a dtype given as a type or a name; ValueError otherwise."""
    try:
        return _DTYPE_NAMES[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported dtype {dtype!r}; use int, float, bool or str") from None


@dataclass
class GenParams:
    """Generation parameters of one gen (None = not set here, inherit from the run's defaults)."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: Any = None
    regex: str | None = None
    json_schema: str | dict | None = None

    @classmethod
    def run_defaults(cls, **overrides: Any) -> "GenParams":
        """The defaults of `f.run(...)` (SGLang's): 128 new tokens, temperature 1, no stop."""
        base = cls(max_new_tokens=128, min_new_tokens=0, stop=[], stop_token_ids=[], temperature=1.0,
                   top_p=1.0, top_k=-1, min_p=0.0, frequency_penalty=0.0, presence_penalty=0.0,
                   ignore_eos=False)
        return base.override(cls(**overrides))

    def override(self, other: "GenParams") -> "GenParams":
        """A copy of self where every field that `other` sets replaces ours."""
        values = {f.name: getattr(other, f.name) for f in dataclasses.fields(self)
                  if getattr(other, f.name) is not None}
        merged = dataclasses.replace(self, **values)
        merged.stop = list(merged.stop_list())
        merged.stop_token_ids = list(merged.stop_token_ids or [])
        return merged

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def constraint(self) -> tuple[dict[str, Any], list[str]]:
        """The engine constraint ({'regex': ...} or {'json_schema': ...} or {}) and the extra stop
        strings that a dtype implies."""
        if self.dtype is not None:
            name = dtype_name(self.dtype)
            extra_stop = [" ", "\n"] if name in ("int", "float") else []
            return {"regex": _DTYPE_REGEX[name]}, extra_stop
        if self.regex is not None:
            return {"regex": self.regex}, []
        if self.json_schema is not None:
            return {"json_schema": self.json_schema}, []
        return {}, []

    def sampling_params(self) -> dict[str, Any]:
        """The `sampling_params` of a native /generate request (the Engine's names)."""
        constraint, extra_stop = self.constraint()
        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "min_new_tokens": self.min_new_tokens,
            "stop": self.stop_list() + [s for s in extra_stop if s not in self.stop_list()],
            "stop_token_ids": list(self.stop_token_ids or []),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "ignore_eos": self.ignore_eos,
            **constraint,
        }
        return {k: v for k, v in params.items() if v is not None}

    def logprob_options(self) -> dict[str, Any]:
        """The request-level logprob fields of a native /generate request."""
        options: dict[str, Any] = {}
        if self.return_logprob:
            options["return_logprob"] = True
            if self.logprob_start_len is not None:
                options["logprob_start_len"] = self.logprob_start_len
            if self.top_logprobs_num:
                options["top_logprobs_num"] = self.top_logprobs_num
        return options

    def openai_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of an OpenAI completions/chat call (the API has no top_k, min_p, ...)."""
        kwargs = {
            "max_tokens": self.max_new_tokens,
            "stop": self.stop_list() or None,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
        }
        return {k: v for k, v in kwargs.items() if v is not None}


class Expr:
    """Base of every IR node. `prev_node` and `pid` (the stream a node belongs to) are set by the
    tracer."""

    _ids = itertools.count()

    def __init__(self) -> None:
        self.node_id = next(Expr._ids)
        self.prev_node: Expr | None = None
        self.pid: Any = None

    def __add__(self, other: "Expr | str") -> "ExprList":
        return ExprList.concat(self, as_expr(other))

    def __radd__(self, other: "Expr | str") -> "ExprList":
        return ExprList.concat(as_expr(other), self)


def as_expr(value: Any) -> Expr:
    """An Expr for a program value: strs become Constant; anything else is a TypeError (SGLang's
    rule: the program converts numbers to text itself)."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Constant(value)
    raise TypeError(f"cannot append a {type(value).__name__} to a program state; append str or "
                    "an sgl expression (convert with str(...) first)")


class ExprList(Expr):
    def __init__(self, exprs: list[Expr]) -> None:
        super().__init__()
        self.exprs = exprs

    @staticmethod
    def concat(a: Expr, b: Expr) -> "ExprList":
        left = a.exprs if isinstance(a, ExprList) else [a]
        right = b.exprs if isinstance(b, ExprList) else [b]
        return ExprList(left + right)

    def __repr__(self) -> str:
        return f"ExprList({self.exprs!r})"


class Constant(Expr):
    def __init__(self, value: str) -> None:
        super().__init__()
        self.value = value

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"


class Gen(Expr):
    def __init__(self, name: str | None, params: GenParams) -> None:
        super().__init__()
        self.name = name
        self.params = params

    def __repr__(self) -> str:
        return f"Gen({self.name!r})"


class Select(Expr):
    def __init__(self, name: str | None, choices: list[str], temperature: float,
                 choices_method: "ChoicesSamplingMethod") -> None:
        super().__init__()
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("select needs a non-empty list of non-empty str choices")
        self.name = name
        self.choices = list(choices)
        self.temperature = temperature
        self.choices_method = choices_method

    def __repr__(self) -> str:
        return f"Select({self.name!r}, choices={self.choices!r})"


class RoleBegin(Expr):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def __repr__(self) -> str:
        return f"RoleBegin({self.role!r})"


class RoleEnd(Expr):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def __repr__(self) -> str:
        return f"RoleEnd({self.role!r})"


class Video(Expr):
    """A video in the prompt, as its frames (each what Image takes)."""

    def __init__(self, frames: Any) -> None:
        super().__init__()
        self.frames = frames

    def __repr__(self) -> str:
        return f"Video({len(self.frames)} frames)"


class Image(Expr):
    """An image in the prompt: a file path, the encoded bytes of one, or a PIL image."""

    def __init__(self, source: Any) -> None:
        super().__init__()
        self.source = source

    def label(self) -> str:
        return self.source if isinstance(self.source, str) else f"<{type(self.source).__name__} image>"

    def __repr__(self) -> str:
        return f"Image({self.label()!r})"


class VarScopeBegin(Expr):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def __repr__(self) -> str:
        return f"VarScopeBegin({self.name!r})"


class VarScopeEnd(Expr):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def __repr__(self) -> str:
        return f"VarScopeEnd({self.name!r})"


class Fork(Expr):
    def __init__(self, number: int) -> None:
        super().__init__()
        self.number = number
        # Constant text that every branch starts with, moved here by the compiler (see compiler.py).
        self.hoisted_text = ""

    def __repr__(self) -> str:
        return f"Fork(number={self.number}, hoisted={self.hoisted_text!r})"


class GetForkItem(Expr):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def __repr__(self) -> str:
        return f"GetForkItem(index={self.index})"


class ConcateAndAppend(Expr):
    """join('concate_and_append'): append the text each fork added, in order, to the parent."""

    def __init__(self, states: list[Any]) -> None:
        super().__init__()
        self.states = states

    def __repr__(self) -> str:
        return f"ConcateAndAppend({len(self.states)} states)"


class CommitLazy(Expr):
    """Send the state's text to the backend now (prefill only), so forks find it in the cache."""

    def __repr__(self) -> str:
        return "CommitLazy()"


class _Placeholder(Expr):
    """A value that only exists when the program runs; during tracing it can be appended to a
    state but not inspected."""

    def _refuse(self, what: str) -> TracingError:
        return TracingError(
            f"{what} {self!r} during tracing: its value is only known when the program runs "
            "(data-dependent control flow or formatting cannot be traced; run the program instead)")

    def __bool__(self) -> bool:
        raise self._refuse("cannot branch on")

    def __eq__(self, other: object) -> bool:
        raise self._refuse("cannot compare")

    __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __eq__
    __hash__ = Expr.__hash__

    def __int__(self) -> int:
        raise self._refuse("cannot convert")

    __float__ = __index__ = __len__ = __int__

    def __iter__(self) -> Any:
        raise self._refuse("cannot iterate over")

    def __getitem__(self, key: Any) -> Any:
        raise self._refuse("cannot index")

    def __contains__(self, item: Any) -> bool:
        raise self._refuse("cannot search")

    def __str__(self) -> str:
        raise self._refuse("cannot format")

    def __format__(self, spec: str) -> str:
        raise self._refuse("cannot format")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise self._refuse(f"cannot call .{name} on")


class Argument(_Placeholder):
    """A program argument whose value was not given when tracing."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def __repr__(self) -> str:
        return f"Argument({self.name!r})"


class Variable(_Placeholder):
    """A reference to a variable of a state: `source` is the node that produces it (traces);
    `executor` is the running stream that holds it (execution)."""

    def __init__(self, name: str, source: Expr | None = None, executor: Any = None) -> None:
        super().__init__()
        self.name = name
        self.source = source
        self.executor = executor

    def __repr__(self) -> str:
        return f"Variable({self.name!r})"
