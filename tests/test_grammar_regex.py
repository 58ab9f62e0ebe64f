"""grammar_to_regex: a grammar written out as one Python regex. Oracles: the terminal's own DFA (for a
terminal written by state elimination), Python's `re` and counting by hand (for the recursion cut)."""

from __future__ import annotations

import itertools
import re

import pytest

from radixlm.core.runtime.constrained import grammar_to_regex, json_schema_to_grammar, regex_to_dfa
from radixlm.core.runtime.constrained.automata.grammar import EMPTY, Grammar, Ref, Terminal, alt, lit, seq


def test_a_dfa_only_terminal_is_written_with_its_exact_language():
    """A number between fractional bounds is a DFA product in the grammar (no regex of its own): its
    regex, by state elimination, accepts exactly what the DFA accepts."""
    grammar = json_schema_to_grammar({"type": "number", "minimum": -5.5, "exclusiveMaximum": 12.25})
    (terminal,) = [t for t in grammar.rules.values() if isinstance(t, Terminal)]
    assert terminal.regex is None and terminal.dfa is not None
    pattern = re.compile(grammar_to_regex(grammar))
    texts = ["".join(p) for n in range(1, 5) for p in itertools.product("-01259.", repeat=n)]
    texts += ["-5.5", "-5.50", "-5.51", "12.25", "12.249", "12.2", "-0", "1e3", "3.14159"]
    accepted = [t for t in texts if terminal.dfa.fullmatch(t)]
    assert len(accepted) > 100
    assert [t for t in texts if pattern.fullmatch(t)] == accepted


def test_recursion_is_cut_at_the_depth():
    """s -> "(" s ")" | "": each rule at most max_depth times on a path, so max_depth - 1 nested pairs."""
    grammar = Grammar({"s": alt(seq(lit("("), Ref("s"), lit(")")), EMPTY)}, "s")
    for depth in (1, 3, 5):
        pattern = re.compile(grammar_to_regex(grammar, max_depth=depth))
        for n in range(8):
            assert bool(pattern.fullmatch("(" * n + ")" * n)) == (n < depth), (depth, n)
        assert not pattern.fullmatch("(()")


def test_what_has_no_regex_form_is_refused_by_name():
    wide = Grammar({"s": Terminal(key="accented", dfa=regex_to_dfa("é+"))}, "s")
    with pytest.raises(ValueError, match="'accented' has no regex form"):
        grammar_to_regex(wide)
    branching = json_schema_to_grammar({})  # any value: 4 references to itself a level
    shallow = re.compile(grammar_to_regex(branching))  # three levels of values: a third holds no member
    assert shallow.fullmatch('{"a":[1,{},"x"]}') and not shallow.fullmatch('{"a":[1,{"b":null}]}')
    with pytest.raises(ValueError, match="passes 131072 characters"):
        grammar_to_regex(branching, max_depth=10)
    nothing = Grammar({"s": seq(lit("a"), Ref("s"))}, "s")  # never ends
    with pytest.raises(ValueError, match="admits no output"):
        grammar_to_regex(nothing)
