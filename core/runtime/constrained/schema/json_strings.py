"""Strings: length bounds (counted strings), ECMA-262 `pattern`, `format`, and the strings a `not`
excludes (a mixin of json_grammar._Converter)."""

from __future__ import annotations

from typing import Any

from radixlm.core.runtime.constrained.automata import json_lexical
from radixlm.core.runtime.constrained.schema.string_patterns import json_string_pattern
from radixlm.core.runtime.constrained.tokens.counted_string import counted_string_dfa
from radixlm.core.runtime.constrained.automata.grammar import Expr, Terminal
from radixlm.core.runtime.constrained.automata.grammar_compiler import derived_dfa, terminal_dfa
from radixlm.core.runtime.constrained.schema.json_common import (NOTHING, NOT_STRINGS, SchemaError, count_bounds,
                                                                 string_terminal)
from radixlm.core.runtime.constrained.automata.dfa_product import dfa_difference, dfa_intersection
from radixlm.core.runtime.constrained.automata.regex_dfa import ByteDFA, sre_c, sre_p


_IPV4_PART = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_H16 = r"[0-9A-Fa-f]{1,4}"
_IPV6 = "|".join([
    rf"(?:{_H16}:){{7}}{_H16}", rf"(?:{_H16}:){{1,7}}:",
    *(rf"(?:{_H16}:){{1,{6 - k}}}(?::{_H16}){{1,{k + 1}}}" for k in range(6)),
    rf":(?::{_H16}){{1,7}}", "::",
])
FORMATS = json_lexical.FORMATS | {
    "duration": r"P(?:[0-9]+W|(?=[0-9T])(?:[0-9]+Y)?(?:[0-9]+M)?(?:[0-9]+D)?(?:T(?=[0-9])(?:[0-9]+H)?(?:[0-9]+M)?(?:[0-9]+S)?)?)",
    "hostname": r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*",
    "ipv4": rf"{_IPV4_PART}(?:\.{_IPV4_PART}){{3}}",
    "ipv6": f"(?:{_IPV6})",
}
# RFC 6570 URI templates, conservatively (a subset that the `uri-template` package, jsonschema's checker,
# accepts too): literals from the URI characters or %XX; expressions of variables [A-Za-z0-9_] with dots, an
# operator of level 2-3, prefix lengths 1-999 or explode.
_VARSPEC = r"[A-Za-z0-9_](?:\.?[A-Za-z0-9_])*(?::[1-9][0-9]{0,2}|\*)?"
FORMATS["uri-template"] = (rf"(?:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]|%[0-9A-Fa-f]{{2}}"
                           rf"|\{{[+#./;?&]?{_VARSPEC}(?:,{_VARSPEC})*\}})*")
# Lookahead is not regular in our engine: durations are "P", then at least one component.
FORMATS["duration"] = (r"P(?:[0-9]+W|[0-9]+Y(?:[0-9]+M)?(?:[0-9]+D)?(?:T_TIME)?|[0-9]+M(?:[0-9]+D)?(?:T_TIME)?"
                       r"|[0-9]+D(?:T_TIME)?|T_TIME)").replace(
    "T_TIME", r"T(?:[0-9]+H(?:[0-9]+M)?(?:[0-9]+S)?|[0-9]+M(?:[0-9]+S)?|[0-9]+S)")


# Length bounds intersected with another automaton (pattern, propertyNames): the product has a copy of it
# per character position and minimizing it is quadratic, so the bounds are kept small. propertyNames'
# maxLength is tightened to this for keys beyond the listed properties (sound: fewer keys), and so is a
# string's maxLength next to a pattern or format (fewer strings); larger minLengths there are refused.
MAX_PRODUCT_LENGTH = 64


class StringRules:
    """The `string` type's rules."""

    def _string(self, schema: dict, ptr: str) -> Expr:
        """The strings `schema` allows, less those a `not` excluded (_negation) or a pattern's leading
        negative lookahead (leading_lookahead)."""
        schema = _lookaheads_out(schema, ptr)
        expr = self._string_body(schema, ptr)
        excluded = schema.get(NOT_STRINGS)
        if not excluded or expr is NOTHING:
            return expr
        budget = self.budget.max_terminal_states
        if not isinstance(expr, Terminal) or expr.dfa is not None and len(expr.dfa.transitions) > budget:
            raise SchemaError(f"{ptr}/not: excluding strings from one of over {self.budget.max_terminal_states} "
                              "states is not supported")

        def build() -> ByteDFA | None:
            dfa = expr.dfa if expr.dfa is not None else terminal_dfa(expr.regex, budget)
            for regex in excluded:
                other = terminal_dfa(regex, budget) if dfa is not None else None
                dfa = dfa_difference(dfa, other, budget, self.deadline.check) if other is not None else dfa
            return dfa

        key = f"{expr.ident}\0not:" + "\0".join(excluded)
        dfa = derived_dfa(key, budget, build)
        return NOTHING if dfa is None else Terminal(key=key, dfa=dfa)

    def _string_body(self, schema: dict, ptr: str) -> Expr:
        lo, hi = count_bounds(schema, "minLength", "maxLength", ptr)
        if hi is not None and hi < lo:
            return NOTHING
        fmt, pattern = schema.get("format"), schema.get("pattern")
        bounded = "minLength" in schema or "maxLength" in schema
        regexes = []  # the patterns and the format all hold where several are given
        # Several patterns: allOf parts with different ones (merged as a list, json_allof.py).
        for p in pattern if isinstance(pattern, list) else [] if pattern is None else [pattern]:
            try:
                regexes.append(f'"{ecma_string_pattern(p)}"')
            except ValueError as e:
                raise SchemaError(f"{ptr}/pattern: {e}") from None
        if fmt in FORMATS and self.formats_asserted:
            regexes.append(f'"{FORMATS[fmt]}"')
        if len(regexes) == 1 and not bounded:
            return Terminal(regex=regexes[0])
        if regexes:
            where = f"{ptr}/pattern" if pattern is not None else f"{ptr}/format"
            return self._within(regexes, lo, hi, bounded, where)
        return string_terminal(lo, hi)  # any length: a long one's moves are computed, not stored

    def _within(self, regexes: list[str], lo: int, hi: int | None, bounded: bool, ptr: str) -> Expr:
        """The JSON strings matching every regex of `regexes` (quotes included), with lo..hi characters
        if `bounded`: their DFAs intersected (with the counted string's)."""
        budget = self.budget.max_terminal_states
        if bounded and lo > MAX_PRODUCT_LENGTH:
            raise SchemaError(f"{ptr}: minLength over {MAX_PRODUCT_LENGTH} together with it is not supported")
        if bounded and hi is not None and hi > MAX_PRODUCT_LENGTH:
            hi = MAX_PRODUCT_LENGTH  # fewer strings (sound); the product stays small

        def build() -> ByteDFA | None:
            dfa = terminal_dfa(regexes[0], budget)
            others = [terminal_dfa(r, budget) for r in regexes[1:]] + ([counted_string_dfa(lo, hi)] if bounded else [])
            for other in others:
                if dfa is not None:
                    dfa = dfa_intersection(dfa, other, budget, self.deadline.check) if other is not None else None
            return dfa

        key = "re:" + "\0and:".join(regexes) + (f"\0length:{lo}:{hi}" if bounded else "")
        dfa = derived_dfa(key, budget, build)
        return NOTHING if dfa is None else Terminal(key=key, dfa=dfa)


def leading_lookahead(pattern: str) -> tuple[str, str] | None:
    """`^(?!X)Y` as (`^Y`, `^(?:X)`): a string matches it iff it matches the first and not the second (the
    lookahead tests what follows the anchored start, as a search from there does); None for any other
    pattern (a lookahead elsewhere is refused by the regex compiler)."""
    if not pattern.startswith("^(?!"):
        return None
    depth, i, in_class = 1, 4, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c in "([)":
            in_class = c == "["
            depth += {"(": 1, ")": -1}.get(c, 0)
            if depth == 0:
                positive, negative = "^" + pattern[i + 1:], f"^(?:{pattern[4:i]})"
                parsed = list(sre_p.parse(pattern))  # the split read the lookahead as the parser does
                if len(parsed) > 1 and parsed[1][0] is sre_c.ASSERT_NOT and \
                        len(parsed) == 1 + len(list(sre_p.parse(positive))):
                    return positive, negative
                return None
        i += 1
    return None


def _lookaheads_out(schema: dict, ptr: str) -> dict:
    """`schema` with its patterns' leading negative lookaheads taken out into the strings it excludes."""
    patterns = schema.get("pattern")
    patterns = patterns if isinstance(patterns, list) else [patterns] if isinstance(patterns, str) else []
    if not any(p.startswith("^(?!") for p in patterns):
        return schema
    kept, excluded = [], list(schema.get(NOT_STRINGS) or ())
    for pattern in patterns:
        while (cut := leading_lookahead(pattern)) is not None:
            pattern = cut[0]
            try:
                excluded.append(f'"{ecma_string_pattern(cut[1])}"')
            except ValueError as e:
                raise SchemaError(f"{ptr}/pattern: {e}") from None
        kept.append(pattern)
    return {**schema, "pattern": kept, NOT_STRINGS: excluded}


def asserts_formats(root: Any) -> bool:
    """Whether `format` constrains strings: yes, unless the schema declares draft 2019-09 or 2020-12,
    where `format` is an annotation (only a metaschema's format-assertion vocabulary makes it assert,
    and metaschemas are remote)."""
    declared = root.get("$schema") if isinstance(root, dict) else None
    return not (isinstance(declared, str) and ("/draft/2019-09/" in declared or "/draft/2020-12/" in declared))


def ecma_string_pattern(pattern: str) -> str:
    """A JSON schema `pattern` (ECMA-262: a search, `\\d` `\\w` ASCII) as a regex over the JSON-escaped
    string content, for a full match between the quotes: an end without an anchor accepts any characters
    there. An end anchored on some alternatives only is treated as anchored (a subset: still sound)."""
    tree = list(sre_p.parse(pattern))
    free = (_anchor(tree, 0) == "none", _anchor(tree, -1) == "none")
    body = json_string_pattern(pattern, ascii_classes=True, free=free)
    any_chars = f"{json_lexical.STRING_CHAR}*"
    return (any_chars if free[0] else "") + body + (any_chars if free[1] else "")


_STARTS = (sre_c.AT_BEGINNING, sre_c.AT_BEGINNING_STRING)
_ENDS = (sre_c.AT_END, sre_c.AT_END_STRING)


def _anchor(items: list, side: int) -> str:
    """'all', 'none' or 'mixed': whether the parsed pattern is anchored at its start (side 0) or end (-1)."""
    if not items:
        return "none"
    op, av = items[side]
    if op is sre_c.AT:
        return "all" if av in (_STARTS if side == 0 else _ENDS) else "none"
    if op is sre_c.SUBPATTERN:
        return _anchor(list(av[3]), side)
    if op is sre_c.BRANCH:
        kinds = {_anchor(list(b), side) for b in av[1]}
        return kinds.pop() if len(kinds) == 1 else "mixed"
    return "none"
