"""JSON schema -> a Grammar (grammar.py) whose every output is a compact JSON document valid under it.

Terminals are small regexes (a string, a number, `"key":`, punctuation); `$ref` targets become rules,
so recursion needs no depth bound and nothing is inlined. An object's optional properties cost one
small rule each ("the rest of the object after member i"), not a copy of the object per alternative.

Keywords: type, enum, const, properties, required, additionalProperties (false, true or a schema),
patternProperties, minProperties/maxProperties, items, prefixItems, minItems/maxItems, uniqueItems (an
approximation that stays sound: json_unique.py), minLength/maxLength, pattern (ECMA-262 search
semantics, `\\d` and `\\w` ASCII), format (date, time, date-time, duration, uuid, email, hostname, ipv4,
ipv6, uri), numeric bounds, multipleOf (whole, or p/q on integers), anyOf, oneOf (exclusive: branches
told apart by types, constants or properties, else each excluding the others with `not`), allOf
(merged), not (by De Morgan over its keywords, json_exclusion.py), if/then/else, $ref and $dynamicRef
(schema_refs.py; recursion allowed; registered documents too), OpenAPI's nullable; annotations ignored.
Objects with `properties` and no `additionalProperties` get exactly their listed properties (a
documented strictness). Anything refused raises ValueError naming the keyword and its JSON pointer.
This module holds the entry point and the dispatch on keywords; the rules per kind of value are mixins
in the json_*.py modules named in _Converter's docstring.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import TYPE_CHECKING, Any

from radixlm.core.runtime.constrained.automata.grammar import Expr, Grammar, Ref, Repeat, Terminal, alt, lit, opt, seq
from radixlm.core.runtime.constrained.automata.grammar_compiler import DEFAULT_BUDGET, Deadline, GrammarBudget
from radixlm.core.runtime.constrained.schema.json_allof import AllOfRules
from radixlm.core.runtime.constrained.schema.json_arrays import ArrayRules
from radixlm.core.runtime.constrained.schema.json_common import (CONFLICT, DEPENDENT_KEYWORDS, IGNORED_KEYWORDS,
                                                                 NOT_STRINGS, REFUSED_KEYWORDS, JSON_TYPES, BOOLEAN,
                                                                 NOT_MULTIPLE_OF, NOTHING, NULL, NUMBER, SchemaError, json_type,
                                                                 mark_negated, open_part, same_json, type_set, with_parts,
                                                                 string_terminal)
from radixlm.core.runtime.constrained.schema.json_conditional import ConditionalRules
from radixlm.core.runtime.constrained.schema.json_exclusion import MAX_NEGATION_DEPTH, ExclusionRules, types_only
from radixlm.core.runtime.constrained.schema.json_numbers import NumberRules
from radixlm.core.runtime.constrained.schema.json_objects import ObjectRules
from radixlm.core.runtime.constrained.schema.json_strings import StringRules, asserts_formats
from radixlm.core.runtime.constrained.schema.json_unique import UniqueRules
from radixlm.core.runtime.constrained.schema.schema_input import load_schema
from radixlm.core.runtime.constrained.schema.schema_merge import SchemaMerge

if TYPE_CHECKING:
    from radixlm.core.runtime.constrained.schema.schema_refs import SchemaRefs

def json_schema_to_grammar(schema: Any, whitespace_pattern: str | None = None,
                           budget: GrammarBudget = DEFAULT_BUDGET, deadline: Deadline | None = None) -> Grammar:
    """The grammar of compact JSON documents valid under `schema` (a JSON string, dict, bool or pydantic
    model class). ValueError naming the keyword and where (JSON pointer) for whatever is refused."""
    # Imported here: `referencing` takes ~0.3 s to import, which the engine's start need not pay.
    from radixlm.core.runtime.constrained.schema.schema_refs import SchemaRefs

    refs = SchemaRefs(load_schema(schema))
    if whitespace_pattern:
        try:
            re.compile(whitespace_pattern)
        except re.error as e:
            raise ValueError(f"invalid whitespace_pattern {whitespace_pattern!r}: {e}") from None
    conv = _Converter(refs, whitespace_pattern or "", budget, deadline or Deadline(budget))
    try:
        conv.rules["start"] = conv.value(refs.root, "#")
        return Grammar(conv.rules, "start")
    finally:
        # Closures and refusals' tracebacks kept during the conversion refer to the converter: cycles,
        # which would hold every schema copy and rule it made until a full collection (their traversal
        # was the largest garbage collection pauses of compiles). Emptied, it holds nothing.
        vars(conv).clear()


def _of_types(value: Any, negated: Any) -> bool:
    """Whether `value` is of a type that `negated` (true, {} or a schema of `type` alone) allows."""
    if not isinstance(negated, dict) or "type" not in negated:
        return negated is True or negated == {}
    return json_type(value) in type_set(negated["type"])


def _scalar_keywords_admit(value: Any, schema: dict) -> bool:
    """Whether a string or number constant meets its schema's length, pattern and range keywords (the
    siblings of enum/const that apply to a constant; object and array keywords are not checked here).
    Numbers compare as Python does (ints and floats exactly); multipleOf as jsonschema computes it."""
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", math.inf):
            return False
        pattern = schema.get("pattern")
        try:  # several patterns: allOf parts with different ones (json_allof.py)
            return all(re.search(p, value) is not None for p in (pattern if isinstance(pattern, list) else [pattern])
                       if isinstance(p, str))
        except re.error:  # a pattern Python cannot read: the pattern's own converter reports it
            return True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return True

    def number(key: str) -> int | float | None:
        bound = schema.get(key)
        return bound if isinstance(bound, (int, float)) and not isinstance(bound, bool) else None

    low, high = number("minimum"), number("maximum")
    if low is not None and (value < low or (schema.get("exclusiveMinimum") is True and value == low)):
        return False  # (a boolean exclusiveMinimum is draft 4's form)
    if high is not None and (value > high or (schema.get("exclusiveMaximum") is True and value == high)):
        return False
    low, high = number("exclusiveMinimum"), number("exclusiveMaximum")
    if (low is not None and value <= low) or (high is not None and value >= high):
        return False
    avoid = schema.get(NOT_MULTIPLE_OF)  # a `not` of multipleOf p/q: integers p does not divide
    if avoid is not None and float(value).is_integer() and int(value) % avoid[0] == 0:
        return False
    step = number("multipleOf")
    if step is None or step <= 0:
        return True
    if isinstance(step, int) and isinstance(value, int):
        return value % step == 0
    quotient = value / step
    return math.isfinite(quotient) and quotient == int(quotient)


class _Converter(ExclusionRules, ConditionalRules, AllOfRules, StringRules, NumberRules, ObjectRules, ArrayRules,
                 UniqueRules, SchemaMerge):
    """value() dispatches on the keywords; each kind of value has its rules in a mixin (json_strings.py,
    json_numbers.py, json_objects.py, json_arrays.py and json_unique.py for uniqueItems, json_exclusion.py
    for not/oneOf, json_conditional.py for if/then/else and dependencies, json_allof.py for allOf) over
    schema_merge.py's allOf merging and ref expansion (for merges)."""

    def __init__(self, refs: SchemaRefs, ws: str, budget: GrammarBudget, deadline: Deadline) -> None:
        self.refs = refs
        self.budget = budget
        self.deadline = deadline
        self.rules: dict[str, Expr] = {}
        self.ref_rules: dict[str, str] = {}
        self.ws_term = Terminal(regex=f"(?:{ws})") if ws else None
        self.negations = 0  # `not`s being converted inside one another (value())
        self.converted: dict[tuple[int, int], tuple[Any, Expr]] = {}  # value()'s, by (not depth, id)
        self.formats_asserted = asserts_formats(refs.root)

    # ---- helpers -------------------------------------------------------------------------------------
    def _punct(self, text: str) -> Expr:
        return seq(opt(self.ws_term), lit(text), opt(self.ws_term)) if self.ws_term else lit(text)

    def _rule(self, name: str, expr: Expr) -> Ref:
        """A rule holding `expr` (so that repetition refers to it instead of copying it)."""
        if name not in self.rules:
            self.rules[name] = expr
        return Ref(name)

    def _shared(self, expr: Expr, ptr: str) -> Expr:
        return expr if isinstance(expr, (Terminal, Ref)) else self._rule(f"{ptr}@{len(self.rules)}", expr)

    # ---- the conversion ----------------------------------------------------------------------------
    def value(self, schema: Any, ptr: str) -> Expr:
        """The grammar of the values `schema` allows; `ptr` names where it sits (rule names, refusals). A
        schema object converted before (the same object, at the same `not` depth) gives its grammar again:
        merges, oneOf exclusions and `$ref`s with siblings meet the same subschemas again and again. (A $ref
        and the types are handled here, not in helpers: a chain of refs nests value() once per link.)"""
        self.deadline.check()
        memo = (self.negations, id(schema))
        found = self.converted.get(memo)
        if found is not None and found[0] is schema:
            return found[1]
        if isinstance(schema, dict) and "$ref" in schema:
            ref = schema["$ref"]
            if not isinstance(ref, str):
                raise SchemaError(f"{ptr}/$ref: must be a string")
            rest = {k: v for k, v in schema.items() if k != "$ref" and k not in IGNORED_KEYWORDS}
            if rest:  # sibling keywords: merged with the target (which is inlined for the merge)
                return self._remember(memo, schema, self.value(with_parts(rest, self._target(ref, ptr)), ptr))
            name = self.ref_rules.get(ref)
            if name is None:
                name = self.ref_rules[ref] = f"ref:{ref}"
                self.rules[name] = NOTHING  # placeholder: recursion refers to the rule by name
                self.rules[name] = self.value(self._target(ref, ptr), ref)
            return Ref(name)
        if schema is True or schema == {}:
            return self._any()
        if schema is False:
            return NOTHING
        if not isinstance(schema, dict):
            raise SchemaError(f"{ptr}: a JSON schema must be an object or a boolean, got {schema!r}")
        for key in schema:
            if key in REFUSED_KEYWORDS:
                raise SchemaError(f"{ptr}/{key}: {REFUSED_KEYWORDS[key]} is not supported")
        if any(k in schema for k in DEPENDENT_KEYWORDS):
            return self._remember(memo, schema, self.value(self._dependents(schema, ptr), ptr))
        if "if" in schema and ("then" in schema or "else" in schema):
            return self._remember(memo, schema, self._conditional(schema, ptr))
        original = schema
        schema = {k: v for k, v in schema.items() if k not in ("then", "else")}
        if "if" in schema:  # alone it constrains nothing, but what it evaluates when it holds counts
            rest = {k: v for k, v in schema.items() if k != "if"}
            if "unevaluatedProperties" in rest or "unevaluatedItems" in rest:
                return alt(self.value(with_parts(rest, schema["if"]), ptr), self.value(rest, ptr))
            schema = rest
        if "not" in schema and not types_only(schema["not"]):  # as positive keywords, merged in
            return self._with_negation(schema, ptr)
        if "allOf" in schema or "anyOf" in schema or "oneOf" in schema:
            return self._remember(memo, original, self._combined(schema, ptr))
        if schema.get("nullable") is True or "const" in schema or "enum" in schema:
            return self._enumerated(schema, ptr)
        types = schema.get("type", list(JSON_TYPES))
        types = [types] if isinstance(types, str) else list(types)
        if "not" in schema:
            types = self._without(types, schema["not"], ptr)
        handlers = {"string": self._string, "integer": self._integer, "number": self._number,
                    "fraction": functools.partial(self._number, fraction=True),
                    "boolean": lambda s, p: BOOLEAN, "null": lambda s, p: NULL, "object": self._object,
                    "array": self._array}
        out = []
        for t in types:
            if t not in handlers:
                raise SchemaError(f"{ptr}/type: unknown JSON schema type {t!r}")
            out.append(handlers[t](schema, ptr))
        return self._remember(memo, original, alt(*out) if out else NOTHING)

    def _with_negation(self, schema: dict, ptr: str) -> Expr:
        """`not` (beyond types) as positive keywords merged into the rest of the schema."""
        rest = {k: v for k, v in schema.items() if k != "not"}
        if self.negations >= MAX_NEGATION_DEPTH:  # a `not` whose positive form holds a `not`, ... (refs)
            raise SchemaError(f"{ptr}/not: 'not' nested deeper than {MAX_NEGATION_DEPTH} levels is not supported")
        negation = self._negation(schema["not"], open_part(rest), f"{ptr}/not")
        self.negations += 1
        try:
            return self.value(with_parts(rest, mark_negated(negation)), ptr)
        finally:
            self.negations -= 1

    def _combined(self, schema: dict, ptr: str) -> Expr:
        """allOf (merged into one schema), anyOf and oneOf (exclusive branches), each branch with the
        schema's other keywords."""
        if "allOf" in schema:
            try:
                merged = self._merge(schema["allOf"] + [{k: v for k, v in schema.items() if k != "allOf"}], ())
            except ValueError as e:
                raise SchemaError(f"{ptr}/allOf: {e}") from None
            return self.value(merged, ptr)
        key = "anyOf" if "anyOf" in schema else "oneOf"
        if "anyOf" in schema and "oneOf" in schema:
            raise SchemaError(f"{ptr}: anyOf together with oneOf is not supported")
        branches = schema[key]
        if not isinstance(branches, list) or not branches:
            raise SchemaError(f"{ptr}/{key}: must be a non-empty list")
        rest = {k: v for k, v in schema.items() if k != key and k not in IGNORED_KEYWORDS}
        subs = [with_parts(rest, b) if rest else b for b in branches]
        if key == "oneOf":
            return alt(*self._exclusive(subs, branches, f"{ptr}/oneOf"))
        return alt(*(self.value(s, f"{ptr}/{key}/{i}") for i, s in enumerate(subs)))

    def _enumerated(self, schema: dict, ptr: str) -> Expr:
        """nullable (the schema or null), const and enum."""
        if schema.get("nullable") is True:
            return alt(self.value({k: v for k, v in schema.items() if k != "nullable"}, ptr), NULL)
        if "const" in schema:
            enum = schema.get("enum")  # both, from an allOf merge: the constant only if the enum has it
            if schema["const"] is CONFLICT or isinstance(enum, list) and not any(
                    same_json(schema["const"], v) for v in enum):
                return NOTHING
            return self._literal(schema["const"], schema, ptr)
        if schema["enum"] is CONFLICT:  # allOf parts whose enums share no value
            return NOTHING
        if not isinstance(schema["enum"], list) or not schema["enum"]:
            raise SchemaError(f"{ptr}/enum: must be a non-empty list")
        return alt(*(self._literal(v, schema, ptr) for v in schema["enum"]))

    def _remember(self, memo: tuple[int, int], schema: Any, expr: Expr) -> Expr:
        """Keeps value()'s result for `schema` (which the entry holds, so that its id stays its own)."""
        self.converted[memo] = (schema, expr)
        return expr

    def _target(self, ref: str, ptr: str) -> Any:
        try:
            return self._resolve(ref)
        except ValueError as e:
            raise SchemaError(f"{ptr}/$ref: {e}") from None

    def _resolve(self, ref: str) -> Any:
        return self.refs.resolve(ref)

    def _literal(self, value: Any, schema: dict, ptr: str) -> Expr:
        """A constant; dropped (NOTHING) when the schema's type excludes it."""
        types = schema.get("type")
        if types is not None:
            types = {types} if isinstance(types, str) else set(types)
            kind = json_type(value)
            if kind not in types and not (kind == "integer" and "number" in types):
                return NOTHING
        text = json.dumps(value, ensure_ascii=False)
        if isinstance(value, str) and any(re.fullmatch(r, text) for r in schema.get(NOT_STRINGS, ())):
            return NOTHING  # a `not` excludes it
        if "not" in schema and types_only(schema["not"]) and _of_types(value, schema["not"]):
            return NOTHING  # {"enum": [3, 4.5], "not": {"type": "integer"}}: 3 is excluded
        if not _scalar_keywords_admit(value, schema):
            return NOTHING  # a sibling keyword excludes it: {"enum": ["abc"], "maxLength": 2}
        return self._constant(value)

    def _constant(self, value: Any) -> Expr:
        """Exactly `value` (a whole float as its integer: 0.0 equals 0 to JSON Schema)."""
        if isinstance(value, float) and value.is_integer() or isinstance(value, int) and not isinstance(value, bool):
            return Terminal(regex=re.escape(str(int(value))))
        if isinstance(value, list):
            items = [self._constant(v) for v in value]
            body = [seq(self._punct(","), v) if i else v for i, v in enumerate(items)]
            return seq(self._punct("["), *body, self._punct("]"))
        if isinstance(value, dict):
            members = [seq(self._key(k), self._constant(v)) for k, v in value.items()]
            body = [seq(self._punct(","), m) if i else m for i, m in enumerate(members)]
            return seq(self._punct("{"), *body, self._punct("}"))
        return lit(json.dumps(value, ensure_ascii=False))

    def _any(self) -> Ref:
        if "any" not in self.rules:
            value = Ref("any")
            comma = self._punct(",")
            items = seq(value, Repeat(seq(comma, value)))
            member = seq(string_terminal(), self._punct(":"), value)
            members = seq(member, Repeat(seq(comma, member)))
            self.rules["any"] = alt(string_terminal(), NUMBER, BOOLEAN, NULL,
                                    seq(self._punct("["), opt(items), self._punct("]")),
                                    seq(self._punct("{"), opt(members), self._punct("}")))
        return Ref("any")
