"""Renders a chat template with jinja2 as transformers' `apply_chat_template` does (the same sandboxed
environment, filters and globals), for conversations of plain JSON data, without importing transformers
(about a CPU second of start-up). core.runtime.tokenizer.light decides which calls come here; the rest go to
transformers itself. tests/test_tokenizer_light.py renders against transformers as the oracle."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils


def is_plain(value: Any) -> bool:
    """Whether value is made only of JSON types (str/int/float/bool/None, lists, tuples, str-keyed dicts):
    what reaches a template unchanged, where transformers would convert other objects first."""
    if value is None or type(value) in (str, int, float, bool):
        return True
    if type(value) in (list, tuple):
        return all(is_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and is_plain(v) for k, v in value.items())
    return False


def render(template: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    """The text of `template` for `messages` (each without None values, as transformers drops them) and
    the other template variables (tools, documents, add_generation_prompt, special tokens, ...)."""
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    return _compile(template).render(messages=messages, **variables)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env.from_string(template)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Not jinja's own tojson, which escapes HTML characters: templates write JSON for the model to read.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without the type itself (whose attributes a
    template could walk out of the sandbox through)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore-prefixed names (a way to CPython's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's own signature trick: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")
