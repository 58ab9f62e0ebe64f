"""Objects: properties, required, additional/pattern properties, propertyNames, min/maxProperties
(a mixin of json_grammar._Converter)."""

from __future__ import annotations

import itertools
import json
from typing import Any

from radixlm.core.runtime.constrained.automata import json_lexical
from radixlm.core.runtime.constrained.tokens.counted_string import CountedStringDFA, counted_string_dfa
from radixlm.core.runtime.constrained.automata.grammar import EMPTY, Expr, Ref, Terminal, alt, lit, seq
from radixlm.core.runtime.constrained.automata.grammar_compiler import derived_dfa, terminal_dfa
from radixlm.core.runtime.constrained.schema.json_common import (NOTHING, IGNORED_KEYWORDS, SchemaError, count_bounds,
                                                                 escape_pointer, pattern_matches, string_terminal)
from radixlm.core.runtime.constrained.schema.json_strings import MAX_PRODUCT_LENGTH, ecma_string_pattern
from radixlm.core.runtime.constrained.automata.dfa_product import dfa_difference, dfa_disjoint, dfa_intersection
from radixlm.core.runtime.constrained.automata.regex_dfa import ByteDFA, literals_dfa


MAX_PATTERN_OVERLAP = 3  # patternProperties: up to this many, a key may match several (2**n - 1 key kinds)
MAX_ANY_ORDER = 3  # an object's optional keys (or those listed only in required): up to this many in any order


class ObjectRules:
    """The `object` type's rules."""

    def _object(self, schema: dict, ptr: str) -> Expr:
        props = schema.get("properties") or {}
        if not isinstance(props, dict):
            raise SchemaError(f"{ptr}/properties: must be an object")
        required = schema.get("required") or []
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{ptr}/required: must be a list of strings")
        patterns = schema.get("patternProperties") or {}
        if not isinstance(patterns, dict):
            raise SchemaError(f"{ptr}/patternProperties: must be an object")
        # Keys no other keyword evaluates fall to unevaluatedProperties. Without either, an object that
        # lists its keys (properties or required) gets exactly those (the documented strictness).
        explicit = schema.get("additionalProperties", schema.get("unevaluatedProperties"))
        extra = explicit if explicit is not None else not props and not patterns and not required
        lo, hi = count_bounds(schema, "minProperties", "maxProperties", ptr)
        names = list(props) + [r for r in required if r not in props]
        key_filter = schema.get("propertyNames", True)
        if key_filter is not True:
            names = self._property_names(names, key_filter, required, ptr)
            if names is None:
                return NOTHING
        key_names = None  # the keys propertyNames allows beyond the listed ones
        if key_filter is not True and (extra is not False or patterns):
            key_names = self._names_dfa(key_filter, ptr)
        members: list[tuple[Expr, bool]] = []
        for name in names:
            matching = [ps for pattern, ps in patterns.items() if pattern_matches(pattern, name, ptr)]
            # A key listed only in required: its value is additional unless a pattern matches the key.
            sub = props.get(name, True if matching or explicit is None else explicit)
            if matching:  # patternProperties apply to listed properties too
                sub = {"allOf": [sub, *matching]}
            key_ptr = f"{ptr}/properties/{escape_pointer(name)}"
            value = self.value(sub, key_ptr)
            members.append((seq(self._key(name), self._shared(value, key_ptr)), name in required))
        extras: list[Expr] = []  # one '"key":value' alternative per kind of extra key
        listed = [json.dumps(n, ensure_ascii=False) for n in names]
        try:
            key_regexes = [f'"{ecma_string_pattern(p)}"' for p in patterns]
        except ValueError as e:
            raise SchemaError(f"{ptr}/patternProperties: {e}") from None
        # A key matching several patterns takes all their schemas: one alternative per set of patterns
        # (with a few patterns; with more, keys matching one pattern only).
        sizes = range(1, len(patterns) + 1) if len(patterns) <= MAX_PATTERN_OVERLAP else [1]
        for chosen in (c for n in sizes for c in itertools.combinations(range(len(patterns)), n)):
            others = [r for j, r in enumerate(key_regexes) if j not in chosen]
            key = self._key_terminal([key_regexes[j] for j in chosen], listed, others, key_names)
            if key is not None:
                subs = [list(patterns.values())[j] for j in chosen]
                p2 = f"{ptr}/patternProperties/{escape_pointer(list(patterns)[chosen[0]])}"
                value = self.value(subs[0] if len(subs) == 1 else {"allOf": subs}, p2)
                extras.append(seq(key, self._punct(":"), self._shared(value, p2)))
        if extra is not False:
            others = [f'"{ecma_string_pattern(p)}"' for p in patterns]
            key = self._key_terminal(json_lexical.STRING, listed, others, key_names)
            if key is not None:
                value = self._any() if extra is True else self.value(extra, f"{ptr}/additionalProperties")
                extras.append(seq(key, self._punct(":"), self._shared(value, f"{ptr}/additionalProperties")))
        # An object's keys are unordered, but a required key in schema order is forced text (jump-forward
        # writes it without decoding): a few optional keys come in any order; required keys in schema
        # order, but for keys listed only in `required` (no schema order), in any order when a few.
        if 2 <= len(members) <= MAX_ANY_ORDER and not any(req for _, req in members):
            return seq(self._punct("{"), self._any_order(members, extras, lo, hi, ptr), self._punct("}"))
        loose = sum(1 for name in names if name not in props)
        orders = [members]
        if 2 <= loose <= MAX_ANY_ORDER:
            fixed = members[:len(members) - loose]
            orders = [fixed + list(p) for p in itertools.permutations(members[len(members) - loose:])]
        body = alt(*(self._members(order, extras, lo, hi, ptr) for order in orders))
        return seq(self._punct("{"), body, self._punct("}"))

    def _any_order(self, members: list[tuple[Expr, bool]], extras: list[Expr], lo: int, hi: int | None,
                   ptr: str) -> Expr:
        """The body of an object whose few listed members come in any order: a rule per set of members
        written (2**n; a required member must be among them), then the extras (_members with no listed
        member left, from that count)."""
        base = f"{ptr}@any{len(self.rules)}"
        required = sum(1 << i for i, (_, req) in enumerate(members) if req)
        tails: dict[int, Expr] = {}  # the extras after n members

        def rest(done: int) -> Expr:
            name = f"{base}/{done}"
            if name not in self.rules:
                self.rules[name] = NOTHING
                n = bin(done).count("1")
                comma = self._punct(",") if n else EMPTY
                take = [seq(comma, member, rest(done | 1 << i)) for i, (member, _) in enumerate(members)
                        if not done >> i & 1 and (hi is None or n < hi)]
                if done & required == required and n not in tails:
                    tails[n] = self._members([], extras, lo, hi, ptr, n)
                tail = [tails[n]] if done & required == required else []
                self.rules[name] = alt(*take, *tail)
            return Ref(name)

        try:
            return rest(0)
        finally:
            del rest  # rest's closure holds rest (and self): a cycle that would keep the converter for the collector

    @staticmethod
    def _property_names(names: list[str], rule: Any, required: list[str], ptr: str) -> list[str] | None:
        """The listed names `propertyNames` allows (None if it rejects a required one)."""
        rule = _name_rule(rule, ptr)
        if rule is False:
            keep = []
        else:
            def ok(name: str, rule: dict) -> bool:
                return (len(name) <= rule.get("maxLength", len(name)) and len(name) >= rule.get("minLength", 0)
                        and ("pattern" not in rule or pattern_matches(rule["pattern"], name, ptr))
                        and ("enum" not in rule or name in rule["enum"])
                        and ("const" not in rule or name == rule["const"])
                        and ("not" not in rule or not ok(name, rule["not"])))
            keep = [n for n in names if ok(n, rule)]
            del ok  # its closure holds itself: no cycle left for the collector
        return None if any(r not in keep for r in required) else keep

    def _members(self, members: list[tuple[Expr, bool]], extras: list[Expr], lo: int, hi: int | None,
                 ptr: str, written: int = 0) -> Expr:
        """The object's body: members in order (optional ones may be left out), then any extras, with
        commas between, between lo and hi members in all (`written` of them already before). Rule (i, n)
        is the rest of the body after i listed members were considered and n written (n counted only as
        far as the bounds need)."""
        cap = max(lo, hi if hi is not None else 0, 1)
        base = f"{ptr}@obj{len(self.rules)}"
        extra = alt(*extras) if extras else None

        def rest(i: int, n: int) -> Expr:
            name = f"{base}/{i}/{n}"
            if name in self.rules:
                return Ref(name)
            self.rules[name] = NOTHING
            comma = self._punct(",") if n else EMPTY
            nxt = min(n + 1, cap)
            if i < len(members):
                member, req = members[i]
                take = seq(comma, member, rest(i + 1, nxt)) if hi is None or n < hi else NOTHING
                body = take if req else alt(take, rest(i + 1, n))
            else:
                can_stop = n >= lo
                more = seq(comma, extra, rest(i, nxt)) if extra is not None and (hi is None or n < hi) else NOTHING
                body = alt(EMPTY, more) if can_stop else more
            self.rules[name] = body
            return Ref(name)

        try:
            return rest(0, min(written, cap))
        finally:
            del rest  # as in _any_order: no cycle left through the closure

    def _key(self, name: str) -> Expr:
        text = json.dumps(name, ensure_ascii=False)
        return lit(text + ":") if not self.ws_term else seq(lit(text), self._punct(":"))

    def _names_dfa(self, rule: Any, ptr: str) -> tuple[ByteDFA | bool, str]:
        """The keys (JSON-quoted) `propertyNames` allows beyond the listed properties: (a DFA, or False
        for none; a name for it)."""
        label = json.dumps(rule, sort_keys=True)
        rule = _name_rule(rule, ptr)
        if rule is False:
            return False, label
        lo, hi = rule.get("minLength", 0), rule.get("maxLength")
        if lo > MAX_PRODUCT_LENGTH:
            raise SchemaError(f"{ptr}/propertyNames/minLength: over {MAX_PRODUCT_LENGTH} is not supported")
        hi = None if hi is None and lo == 0 else min(MAX_PRODUCT_LENGTH if hi is None else hi, MAX_PRODUCT_LENGTH)

        def build() -> ByteDFA | None:
            dfa = self._names_matching(rule, counted_string_dfa(lo, hi), ptr)
            if dfa is not None and "not" in rule:  # less the names its `not` matches
                excluded = self._names_matching(rule["not"], counted_string_dfa(0, None), f"{ptr}/not")
                if excluded is not None:
                    dfa = dfa_difference(dfa, excluded, self.budget.max_terminal_states, self.deadline.check)
            return dfa

        dfa = derived_dfa(f"propertyNames:{label}", self.budget.max_terminal_states, build)
        return (dfa if dfa is not None else False), label

    def _names_matching(self, rule: dict, dfa: ByteDFA | None, ptr: str) -> ByteDFA | None:
        """`dfa` intersected with the names `rule`'s pattern, enum and const allow (None if none)."""
        budget = self.budget.max_terminal_states
        parts = []
        if "pattern" in rule:
            try:
                parts.append(terminal_dfa(f'"{ecma_string_pattern(rule["pattern"])}"', budget))
            except ValueError as e:
                raise SchemaError(f"{ptr}/propertyNames/pattern: {e}") from None
        for key in ("enum", "const"):
            if key in rule:
                values = rule[key] if key == "enum" else [rule[key]]
                words = [json.dumps(v, ensure_ascii=False).encode() for v in values if isinstance(v, str)]
                parts.append(literals_dfa(words) if words else None)
        for part in parts:
            if dfa is not None:
                dfa = dfa_intersection(dfa, part, budget, self.deadline.check) if part is not None else None
        return dfa

    def _key_terminal(self, regex: str | list[str], names: list[str], patterns: list[str],
                      allowed: tuple[ByteDFA | bool, str] | None = None) -> Terminal | None:
        """Keys matching `regex` (each of them, if a list; and propertyNames' `allowed` keys, _names_dfa)
        but none of the listed `names` (JSON-quoted) nor other `patterns` (regexes); None if no key is left."""
        if allowed is not None and allowed[0] is False:
            return None
        budget = self.budget.max_terminal_states
        regexes = [regex] if isinstance(regex, str) else regex
        # Names the first regex cannot match need no excluding: the terminal of patternProperties' "^x-"
        # is then one for every object, whatever else they list (one product per process, not per object).
        first = terminal_dfa(regexes[0], budget)
        names = [n for n in names if first is not None and first.fullmatch(n)]

        # A length-only propertyNames is a counted string, all of whose strings are JSON strings: its product
        # with the key regex of additionalProperties is itself, kept counted (masks counted, not walked).
        counted = allowed is not None and isinstance(allowed[0], CountedStringDFA) and regexes == [json_lexical.STRING]

        def build() -> ByteDFA | None:
            dfa = allowed[0] if counted else terminal_dfa(regexes[0], budget)
            for other in regexes[1:]:
                if dfa is not None:
                    both = terminal_dfa(other, budget)
                    dfa = dfa_intersection(dfa, both, budget, self.deadline.check) if both is not None else None
            if dfa is not None and allowed is not None and not counted:
                dfa = dfa_intersection(dfa, allowed[0], budget, self.deadline.check)
            if dfa is not None and names:
                dfa = dfa_difference(dfa, literals_dfa([n.encode() for n in names]), budget, self.deadline.check)
            for pattern in patterns:
                if dfa is not None:
                    other = terminal_dfa(pattern, budget)
                    if other is not None and not dfa_disjoint(dfa, other):
                        dfa = dfa_difference(dfa, other, budget, self.deadline.check)
            return dfa

        excluded = names + patterns
        if allowed is not None:  # terminals are shared by key: name the filter too
            excluded.append(f"propertyNames:{allowed[1]}")
        key = "key:" + "\0and:".join(regexes) + "\0" + "\0".join(excluded)
        dfa = derived_dfa(key, budget, build)
        if isinstance(dfa, CountedStringDFA):  # nothing excluded: the counted string itself
            return string_terminal(dfa.lo, dfa.hi)
        plain = regexes[0] if len(regexes) == 1 and not excluded else None  # the same language, as a regex
        return None if dfa is None else Terminal(regex=plain, key=key, dfa=dfa)


def _name_rule(rule: Any, ptr: str) -> dict | bool:
    """propertyNames as the keywords _property_names and _names_dfa read (pattern, lengths, enum, const,
    a `not` of pattern/enum/const), or False for no names. A `type` allowing strings says nothing of
    names (they are strings); one that does not allows none."""
    if rule is False:
        return False
    body = {k: v for k, v in rule.items() if k not in IGNORED_KEYWORDS} if isinstance(rule, dict) else None
    if body is not None and "type" in body:
        types = [body.pop("type")] if isinstance(rule["type"], str) else body.pop("type")
        if "string" not in types:
            return False
    negated = body.get("not") if body is not None else None
    if body is None or set(body) - {"pattern", "maxLength", "minLength", "enum", "const", "not"} or (
            "not" in body and not (isinstance(negated, dict) and negated
                                   and set(negated) - IGNORED_KEYWORDS <= {"pattern", "enum", "const"})):
        raise SchemaError(f"{ptr}/propertyNames: only type, pattern, lengths, enum, const and a not of "
                          "pattern/enum/const are supported")
    return body
