"""Schemas with long strings (maxLength 32767, as many real schemas have, 4096, a minLength) and instances
of real text, for bench_grammar.py's corpus: a long string's masks must cost what a short one's do."""

from __future__ import annotations

import json
import re
import textwrap

# Real prose in several scripts: the docstrings of a few standard modules, and a multilingual paragraph.
_MULTILINGUAL = ("Die Straße führt nach Zürich. 日本語のテキストを書きます。 Ελληνικά κείμενα. Русский текст. "
                 "العربية نص. हिन्दी पाठ. 한국어 문장. Emoji 😀🎉 and quotes \"like this\", tabs\tand back\\slashes.\n")


def _prose() -> str:
    import collections
    import functools
    import itertools

    parts = [m.__doc__ or "" for m in (json, re, textwrap, collections, functools, itertools)]
    return "\n".join(p.strip() for p in parts) + "\n" + _MULTILINGUAL


def long_string_cases() -> list[dict]:
    prose = _prose()
    long_text = (prose * (32767 // len(prose) + 1))[:32767]
    text = {"type": "string", "maxLength": 32767}
    return [
        {"name": "long/text-32767", "schema": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 200},
                                                                              "body": text},
                                               "required": ["title", "body"], "additionalProperties": False},
         "valid": [{"title": "Modules", "body": prose}, {"title": "", "body": long_text}],
         "invalid": [{"title": "Too long", "body": long_text + "!"}, {"title": "x" * 201, "body": ""}]},
        {"name": "long/notes-4096", "schema": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 4096},
                                               "maxItems": 8},
         "valid": [[prose[:4096], _MULTILINGUAL, prose[-3000:]]],
         "invalid": [[prose[:4097]], [""]]},
        {"name": "long/min-1000", "schema": {"type": "string", "minLength": 1000, "maxLength": 32767},
         "valid": [prose[:1000], prose], "invalid": [prose[:999]]},
    ]
