"""A regex over decoded string content rewritten over the JSON-escaped content between a string's
quotes (JSON Schema's `pattern`, propertyNames, patternProperties keys): every character set loses quote,
backslash and control characters and matches their escapes instead."""

from __future__ import annotations

import json
import re

from radixlm.core.runtime.constrained.automata import charsets
from radixlm.core.runtime.constrained.automata.regex_dfa import char_set_ranges, sre_c, sre_p, unsupported_construct


def _repeat(item: str, lo: int, hi: int | None) -> str:
    if hi is None:
        return f"(?:{item}){{{lo},}}" if lo else f"(?:{item})*"
    return f"(?:{item}){{{lo},{hi}}}" if lo != hi else f"(?:{item}){{{lo}}}"


_JSON_SPECIALS: charsets.Ranges = ((0, 0x1F), (0x22, 0x22), (0x5C, 0x5C))


def json_string_pattern(pattern: str, ascii_classes: bool = False, free: tuple[bool, bool] = (False, False)) -> str:
    """`pattern` (a regex over decoded string content) rewritten over the JSON-escaped content: every
    character set loses quote, backslash and control characters, and matches their escapes instead.
    Anchors at the ends are dropped (the string's quotes anchor it). `ascii_classes`: `\\d \\w \\s`
    match ASCII only (ECMA-262's `\\d` and `\\w`; its `\\s` is wider, so `\\S` may admit Unicode spaces).
    `free` (start, end): any characters may come before / after the match (a search, unanchored there);
    a repetition at such an end then needs only its least count (the same language, a smaller automaton:
    "$[a-z]{1,255}" searched is "$[a-z]" searched)."""
    try:
        tree = sre_p.parse(pattern)
    except re.error as e:
        raise ValueError(f"invalid 'pattern' {pattern!r}: {e}") from None
    return _emit(tree, tree.state.flags | (re.ASCII if ascii_classes else 0), True, True, free)


def _emit(seq, flags: int, at_start: bool, at_end: bool, free: tuple[bool, bool] = (False, False)) -> str:
    items = list(seq)
    out = []
    for i, (op, av) in enumerate(items):
        first = at_start and all(o is sre_c.AT for o, _ in items[:i])
        last = at_end and all(o is sre_c.AT for o, _ in items[i + 1:])
        out.append(_emit_node(op, av, flags, first, last, (free[0] and i == 0, free[1] and i == len(items) - 1)))
    return "".join(out)


def _emit_node(op, av, flags: int, at_start: bool, at_end: bool, free: tuple[bool, bool]) -> str:
    if op in (sre_c.LITERAL, sre_c.NOT_LITERAL, sre_c.ANY, sre_c.IN):
        return _escaped_char_set(char_set_ranges(op, av, flags))
    if op is sre_c.SUBPATTERN:
        _group, add_flags, del_flags, sub = av
        return f"(?:{_emit(sub, (flags | add_flags) & ~del_flags, at_start, at_end, free)})"
    if op is sre_c.BRANCH:
        return "(?:" + "|".join(_emit(alt, flags, at_start, at_end, free) for alt in av[1]) + ")"
    if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT):
        lo, hi, sub = av
        if any(free):  # a match with more repetitions holds one with `lo` of them
            return _repeat(_emit(sub, flags, False, False), lo, lo) if lo else ""
        return _repeat(_emit(sub, flags, False, False), lo, None if hi == sre_c.MAXREPEAT else hi)
    if op is sre_c.AT:
        if av in (sre_c.AT_BEGINNING, sre_c.AT_BEGINNING_STRING) and at_start:
            return ""
        if av in (sre_c.AT_END, sre_c.AT_END_STRING) and at_end:
            return ""
        raise ValueError(f"unsupported construct in 'pattern': anchor or boundary {av}")
    name = unsupported_construct(op, av)
    raise ValueError(f"unsupported construct in 'pattern': {name or op}")


def _escaped_char_set(ranges: charsets.Ranges) -> str:
    plain = charsets.subtract(ranges, _JSON_SPECIALS)
    alternatives = []
    if plain:
        alternatives.append("[" + "".join(
            f"\\U{lo:08x}" if lo == hi else f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in plain) + "]")
    # The escapes json.dumps writes for quote, backslash and controls, grouped: a backslash and one of
    # the letters, or "\u00" and hex digits by the third one (was one alternative per character: ~34
    # per `.` of a pattern, which made its automaton's construction several times slower).
    escapes = [json.dumps(chr(c))[1:-1] for lo, hi in charsets.intersect(ranges, _JSON_SPECIALS)
               for c in range(lo, hi + 1)]
    letters = "".join(e[1] for e in escapes if len(e) == 2)
    if letters:
        alternatives.append(r"\\[" + re.escape(letters) + "]")
    by_digit: dict[str, str] = {}
    for e in escapes:
        if len(e) == 6:  # \u00XY
            by_digit[e[4]] = by_digit.get(e[4], "") + e[5]
    if by_digit:
        alternatives.append(r"\\u00(?:" + "|".join(f"{x}[{ys}]" for x, ys in by_digit.items()) + ")")
    if not alternatives:
        return "[^\\x00-\\U0010ffff]"  # matches nothing
    return alternatives[0] if len(alternatives) == 1 else "(?:" + "|".join(alternatives) + ")"
