"""Grammar (grammar.py) -> CompiledGrammar: one byte DFA per terminal, one small automaton per rule.

A rule's automaton reads symbols (terminals and rules), not bytes: Thompson construction over the
rule's expression, then subset construction. It stays small however large the languages of its
terminals are, which is what keeps compiling in milliseconds: no byte-level automaton of the whole
grammar is ever built. Terminal DFAs come from regex_dfa (cached by regex, shared between grammars).
Rules that can never finish are dropped with every edge into them; a start rule that cannot finish,
left recursion and any budget overrun raise (GrammarBudgetError for budgets).
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from radixlm.core.runtime.constrained.automata.dfa_minimize import reaching
from radixlm.core.runtime.constrained.automata.grammar import Alt, Expr, Grammar, Ref, Repeat, Seq, Terminal
from radixlm.core.runtime.constrained.automata.regex_dfa import ByteDFA, epsilon_reachable, regex_to_dfa
from radixlm.core.errors import GrammarBudgetError


@dataclass(frozen=True)
class GrammarBudget:
    """Limits on what one constraint may cost; past a compile budget GrammarBudgetError (HTTP 400)."""

    max_compile_seconds: float = 2.0  # converting and compiling (terminal DFAs included)
    max_terminal_states: int = 20_000  # states of one terminal's DFA
    max_rule_states: int = 200_000  # states of all rule automata together
    # Parser configurations (~1.2 KB each) one shared index holds before new requests get a fresh one.
    max_configs: int = 200_000
    # Wall-clock seconds a new index spends building the token classes and exit walks of the configurations
    # a request most likely meets first (GrammarIndex._warm), so its first masks find them ready; 0: none,
    # those masks build them (the default: a compile's median was this warm-up's 4 ms, docs/constrained.md).
    warm_seconds: float = 0.0


DEFAULT_BUDGET = GrammarBudget()


@dataclass
class RuleAutomaton:
    """States 0.. (0 = start); edges[s] = ((symbol, target), ...), symbol = 2 * terminal or 2 * rule + 1.
    Tuples of numbers, which the cyclic collector stops tracking: a large grammar's rules have thousands of
    states, lists of which every full collection would walk while its index lives (inside a mask)."""

    name: str
    edges: tuple[tuple[tuple[int, int], ...], ...]
    accepting: tuple[bool, ...]


@dataclass
class CompiledGrammar:
    terminals: list[ByteDFA]
    terminal_names: list[str]
    rules: list[RuleAutomaton]
    start: int
    budget: GrammarBudget


class Deadline:
    """The end of a constraint's compile-time budget (conversion and compilation together)."""

    def __init__(self, budget: GrammarBudget) -> None:
        self.budget = budget
        self.end = time.monotonic() + budget.max_compile_seconds

    def check(self) -> None:
        if time.monotonic() > self.end:
            raise GrammarBudgetError(f"compiling the constraint took over {self.budget.max_compile_seconds} s "
                                     "(GrammarBudget.max_compile_seconds)")


@functools.lru_cache(maxsize=2048)
def terminal_dfa(regex: str, max_states: int) -> ByteDFA | None:
    """The minimal DFA of a terminal regex, or None if it matches nothing (cached)."""
    try:
        return regex_to_dfa(regex, max_states=max_states)
    except GrammarBudgetError as e:
        raise GrammarBudgetError(f"{e} (GrammarBudget.max_terminal_states)") from None
    except ValueError as e:
        if "matches no string" in str(e):
            return None
        raise


DERIVED_CACHE_SIZE = 256  # derived terminal DFAs kept per process (a large one is ~1 MB)
_derived: OrderedDict[tuple[str, int], ByteDFA | None] = OrderedDict()


def derived_dfa(key: str, max_states: int, build: Callable[[], ByteDFA | None]) -> ByteDFA | None:
    """The DFA of the terminal named `key` that `build` makes from others (products, differences: key
    terminals, patterns with lengths, strings a `not` excludes), cached by that name, which says all it
    depends on (terminals with equal keys are one terminal): a schema meets the same one at every use of
    an object or string schema, and schemas share them. Failures (budgets) are not cached."""
    found = _derived.get((key, max_states), _derived)
    if found is _derived:
        found = build()
        _derived[(key, max_states)] = found
        if len(_derived) > DERIVED_CACHE_SIZE:
            _derived.popitem(last=False)
    return found


def compile_grammar(grammar: Grammar, budget: GrammarBudget = DEFAULT_BUDGET,
                    deadline: Deadline | None = None) -> CompiledGrammar:
    deadline = deadline or Deadline(budget)
    builder = _Builder(grammar, budget, deadline)
    rule_ids = {name: i for i, name in enumerate(grammar.rules)}
    rules = []
    for name, expr in grammar.rules.items():
        rules.append(builder.rule(name, expr, rule_ids))
        deadline.check()
    terminals = builder.terminal_dfas
    _prune(rules, terminals, builder.finishing, builder.symbols)
    start = rule_ids[grammar.start]
    if not rules[start].accepting or not _reaches_accept(rules[start]):
        raise ValueError("the grammar admits no value (contradictory constraints, or recursion without a way to stop)")
    _check_left_recursion(rules, terminals)
    return CompiledGrammar(terminals, builder.terminal_names, rules, start, budget)


SHAPE_CACHE_SIZE = 8192  # rule automata kept per process, by shape (most are a few states)
# A rule's shape: its expression with each distinct symbol replaced by the order of its first use (0, 1,
# ...); Seq, Alt and Repeat as ("s", ...), ("a", ...), ("r", lo, hi, item). Rules of one shape have one
# automaton up to renaming its symbols, and an object schema's rules come in few shapes ("," key value
# rest | rest), so the automaton is built once per shape for every grammar of the process.
# Each with whether every state of the automaton can finish (when every symbol can be read). Held as tuples of
# numbers, which Python's collector stops tracking (thousands of lists otherwise: narrow_walk's rows say why).
_Edges = tuple[tuple[tuple[int, int], ...], ...]  # per state, its (symbol place, next state) moves
_shapes: OrderedDict[tuple | int, tuple[_Edges, tuple[bool, ...], bool]] = OrderedDict()


class _Builder:
    """Each rule's automaton: its shape's (_shapes, else built by _ShapeAutomaton) with its symbols."""

    def __init__(self, grammar: Grammar, budget: GrammarBudget, deadline: Deadline) -> None:
        self.grammar = grammar
        self.budget = budget
        self.deadline = deadline
        self.terminal_ids: dict[str, int] = {}
        self.terminal_dfas: list[ByteDFA | None] = []
        self.terminal_names: list[str] = []
        self.total_states = 0
        self.finishing: list[bool] = []  # per rule: whether its automaton's every state can finish
        self.symbols: list[list[int]] = []  # per rule: the distinct symbols it reads

    def _terminal(self, t: Terminal) -> int:
        ident = t.ident
        found = self.terminal_ids.get(ident)
        if found is None:
            if t.dfa is not None:
                dfa = t.dfa
            elif t.regex is not None:
                dfa = terminal_dfa(t.regex, self.budget.max_terminal_states)
            else:
                raise ValueError("a terminal needs a regex or a DFA")
            self.deadline.check()
            found = self.terminal_ids[ident] = len(self.terminal_dfas)
            self.terminal_dfas.append(dfa)
            self.terminal_names.append(ident)
        return found

    def rule(self, name: str, expr: Expr, rule_ids: dict[str, int]) -> RuleAutomaton:
        symbols: list[int] = []
        shape = self._shape(expr, rule_ids, symbols, {})
        template = _shapes.get(shape)
        if template is None:
            limit = 2 * self.budget.max_rule_states - self.total_states
            edges, accepting = _ShapeAutomaton(limit, self.deadline).build(shape)
            finishes = all(_finishing_states(edges, accepting))
            template = _shapes[shape] = tuple(map(tuple, edges)), tuple(accepting), finishes
            if len(_shapes) > SHAPE_CACHE_SIZE:
                _shapes.popitem(last=False)
        edges, accepting, finishes = template
        self.finishing.append(finishes)
        self.symbols.append(symbols)
        self.total_states += len(edges)
        if self.total_states > self.budget.max_rule_states:
            raise GrammarBudgetError(f"the grammar's rules exceed {self.budget.max_rule_states} states "
                                     "(GrammarBudget.max_rule_states)")
        return RuleAutomaton(name, tuple(tuple((symbols[p], t) for p, t in row) for row in edges), accepting)

    def _shape(self, expr: Expr, rule_ids: dict[str, int], symbols: list[int], index: dict[int, int]) -> tuple | int:
        """`expr`'s shape (above); appends its distinct symbols to `symbols` (`index`: symbol -> place)."""
        kind = type(expr)  # (the expression classes have no subclasses; a type test is the hot path's cheapest)
        if kind is Terminal:
            symbol = 2 * self._terminal(expr)
        elif kind is Ref:
            found = rule_ids.get(expr.rule)
            if found is None:
                raise ValueError(f"undefined grammar rule {expr.rule!r}")
            symbol = 2 * found + 1
        elif kind is Seq or kind is Alt:
            return ("s" if kind is Seq else "a", *[self._shape(item, rule_ids, symbols, index) for item in expr.items])
        elif kind is Repeat:
            return ("r", expr.lo, expr.hi, self._shape(expr.item, rule_ids, symbols, index))
        else:
            raise ValueError(f"not a grammar expression: {expr!r}")
        place = index.get(symbol)
        if place is None:
            place = index[symbol] = len(symbols)
            symbols.append(symbol)
        return place


class _ShapeAutomaton:
    """Thompson construction over a shape's symbols (its places), then subset construction."""

    def __init__(self, max_states: int, deadline: Deadline) -> None:
        self.max_states = max_states
        self.deadline = deadline
        self.eps: list[list[int]] = []
        self.sym: list[list[tuple[int, int]]] = []

    def build(self, shape: tuple | int) -> tuple[list[list[tuple[int, int]]], list[bool]]:
        start, end = self._frag(shape)
        return self._determinize(start, end)

    def _new(self) -> int:
        if len(self.eps) >= self.max_states:
            raise GrammarBudgetError(f"the grammar's rules exceed {self.max_states // 2} states "
                                     "(GrammarBudget.max_rule_states)")
        self.eps.append([])
        self.sym.append([])
        return len(self.eps) - 1

    def _frag(self, shape: tuple | int) -> tuple[int, int]:
        if isinstance(shape, int):
            s, e = self._new(), self._new()
            self.sym[s].append((shape, e))
            return s, e
        kind = shape[0]
        if kind == "s":
            start = cur = self._new()
            for item in shape[1:]:
                s, e = self._frag(item)
                self.eps[cur].append(s)
                cur = e
            return start, cur
        if kind == "a":
            start, end = self._new(), self._new()
            for item in shape[1:]:
                s, e = self._frag(item)
                self.eps[start].append(s)
                self.eps[e].append(end)
            return start, end
        _, lo, hi, item = shape
        start = cur = self._new()
        for _ in range(lo):
            s, e = self._frag(item)
            self.eps[cur].append(s)
            cur = e
        if hi is None:
            loop = self._new()
            self.eps[cur].append(loop)
            s, e = self._frag(item)
            self.eps[loop].append(s)
            self.eps[e].append(loop)
            return start, loop
        end = self._new()
        for _ in range(hi - lo):
            self.eps[cur].append(end)
            s, e = self._frag(item)
            self.eps[cur].append(s)
            cur = e
        self.eps[cur].append(end)
        return start, end

    def _determinize(self, start: int, end: int) -> tuple[list[list[tuple[int, int]]], list[bool]]:
        eps, sym = self.eps, self.sym

        def closure(states) -> frozenset[int]:
            return frozenset(s for s in epsilon_reachable(states, eps) if sym[s] or s == end)

        first = closure([start])
        ids, sets, edges = {first: 0}, [first], []
        while len(edges) < len(sets):
            by_symbol: dict[int, list[int]] = {}
            for s in sets[len(edges)]:
                for symbol, target in sym[s]:
                    by_symbol.setdefault(symbol, []).append(target)
            row = []
            for symbol, targets in by_symbol.items():
                subset = closure(targets)
                j = ids.get(subset)
                if j is None:
                    j = ids[subset] = len(sets)
                    sets.append(subset)
                row.append((symbol, j))
            edges.append(row)
            if len(edges) % 1024 == 0:
                self.deadline.check()
            if len(sets) > self.max_states // 2:
                raise GrammarBudgetError(f"the grammar's rules exceed {self.max_states // 2} states "
                                         "(GrammarBudget.max_rule_states)")
        return edges, [end in s for s in sets]


def _reaches_accept(rule: RuleAutomaton) -> bool:
    seen, stack = {0}, [0]
    while stack:
        s = stack.pop()
        if rule.accepting[s]:
            return True
        for _, t in rule.edges[s]:
            if t not in seen:
                seen.add(t)
                stack.append(t)
    return False


def _finishing_states(edges: list[list[tuple[int, int]]], accepting: list[bool],
                      usable: list[bool] | None = None) -> list[bool]:
    """Per state of an automaton: whether it reaches an accepting state over edges on usable symbols
    (`usable[symbol]`; every symbol where None)."""
    preds: list[list[int]] = [[] for _ in edges]
    for s, row in enumerate(edges):
        for sym, t in row:
            if usable is None or usable[sym]:
                preds[t].append(s)
    return reaching(preds, accepting)


def _productive(rules: list[RuleAutomaton], usable_terminals: list[bool]) -> list[bool]:
    """Which rules can finish: a search from each rule's start over usable terminals and rules known to
    finish; a rule whose search met others not known yet is searched again once one of them is."""
    productive = [False] * len(rules)
    blocked: dict[int, list[int]] = {}  # rule -> the rules whose search it stopped
    queue = list(range(len(rules)))
    while queue:
        r = queue.pop()
        if productive[r]:
            continue
        edges, accepting = rules[r].edges, rules[r].accepting
        seen, stack, waits = {0}, [0], set()
        while stack and not accepting[stack[-1]]:
            for sym, t in edges[stack.pop()]:
                if not (productive[sym >> 1] if sym % 2 else usable_terminals[sym >> 1]):
                    if sym % 2:
                        waits.add(sym >> 1)
                elif t not in seen:
                    seen.add(t)
                    stack.append(t)
        if stack:  # an accepting state was reached
            productive[r] = True
            queue.extend(blocked.pop(r, ()))
        else:
            for w in waits:
                blocked.setdefault(w, []).append(r)
    return productive


def _prune(rules: list[RuleAutomaton], terminals: list[ByteDFA | None], finishing: list[bool],
           symbols: list[list[int]]) -> None:
    """Drops edges on symbols that can never be completed (empty terminals, rules that cannot finish)
    and the states that can then no longer finish. `finishing[r]`: whether every state of rule r's
    automaton can finish when every symbol is usable; such a rule with every symbol usable stays as it is."""
    usable_terminals = [t is not None for t in terminals]
    productive = _productive(rules, usable_terminals)
    usable = [False] * (2 * max(len(terminals), len(rules)))  # by symbol: 2 * terminal, 2 * rule + 1
    usable[0:2 * len(terminals):2] = usable_terminals
    usable[1:2 * len(rules):2] = productive
    for rule, whole, read in zip(rules, finishing, symbols):
        if whole and all(usable[sym] for sym in read):
            continue
        live = _finishing_states(rule.edges, rule.accepting, usable)
        rule.edges = tuple(tuple((sym, t) for sym, t in row if live[t] and usable[sym]) if live[s] else ()
                           for s, row in enumerate(rule.edges))
        rule.accepting = tuple(a and live[s] for s, a in enumerate(rule.accepting))


def _check_left_recursion(rules: list[RuleAutomaton], terminals: list[ByteDFA | None]) -> None:
    """Raises if a rule can call itself before reading any byte (the parser would never stop expanding)."""
    # The states each rule reaches from its start reading nothing: over terminals that match the empty
    # string and rules that can finish so (nullable); an edge on a rule not yet known nullable waits for it.
    empty = [t is not None and bool(t.accepting[0]) for t in terminals]
    nullable = [False] * len(rules)
    reached = [{0} for _ in rules]
    waiting: list[list[tuple[int, int]]] = [[] for _ in rules]
    calls: list[list[int]] = [[] for _ in rules]  # per rule: the rules it calls from those states
    stack = [(r, 0) for r in range(len(rules))]
    while stack:
        r, s = stack.pop()
        follow = []
        if rules[r].accepting[s] and not nullable[r]:
            nullable[r] = True
            follow, waiting[r] = waiting[r], []
        for sym, t in rules[r].edges[s]:
            if sym & 1:
                calls[r].append(sym >> 1)
                if nullable[sym >> 1]:
                    follow.append((r, t))
                else:
                    waiting[sym >> 1].append((r, t))
            elif empty[sym >> 1]:
                follow.append((r, t))
        for q, t in follow:
            if t not in reached[q]:
                reached[q].add(t)
                stack.append((q, t))
    state = [0] * len(rules)  # 0 unvisited, 1 on the path, 2 done

    def visit(r: int) -> None:
        state[r] = 1
        for c in calls[r]:
            if state[c] == 1:
                raise ValueError(f"left recursion through grammar rule {rules[c].name!r} is not supported")
            if state[c] == 0:
                visit(c)
        state[r] = 2

    try:
        for r in range(len(rules)):
            if state[r] == 0:
                visit(r)
    finally:
        del visit  # its closure holds itself and the rules: no cycle left for the collector


LIST_FLAGS = 1 << 14


def terminal_tables(grammar: CompiledGrammar) -> tuple[tuple[np.ndarray, ...], tuple[tuple[bool, ...], ...]]:
    """Per terminal: its transition table [n, 256] (-1 = none) and accepting flags (empty for None). Tuples,
    not lists: the cyclic collector stops tracking a tuple of bools (or of such tuples), so a live index's
    flags (thousands for a large terminal) are not walked by every full collection."""
    trans = tuple(t.transitions if t is not None else np.zeros((0, 256), np.int32) for t in grammar.terminals)
    # A long counted string's ~460k flags stay an array (a tuple of them would cost ms per index).
    acc = tuple(() if t is None else t.accepting if len(t.accepting) > LIST_FLAGS else tuple(t.accepting.tolist())
                for t in grammar.terminals)
    return trans, acc
