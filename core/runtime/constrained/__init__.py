"""radixlm.core.runtime.constrained: regex, JSON schema and choices -> a grammar of small regex terminals ->
a lazily determinized pushdown automaton -> token masks and jump-forward per request (one engine; the
optional llguidance package behind the same interface). See docs/constrained.md."""

from radixlm.core.runtime.constrained.grammar_constraint import GrammarConstraint, build_constraint
from radixlm.core.runtime.constrained.automata.grammar import Grammar
from radixlm.core.runtime.constrained.automata.grammar_compiler import GrammarBudget, compile_grammar
from radixlm.core.runtime.constrained.automata.grammar_regex import grammar_to_regex
from radixlm.core.runtime.constrained.schema.json_grammar import json_schema_to_grammar
from radixlm.core.runtime.constrained.tokens.masks import apply_token_masks
from radixlm.core.runtime.constrained.pda import GrammarIndex
from radixlm.core.runtime.constrained.automata.regex_dfa import ByteDFA, regex_to_dfa

FSMConstraint = GrammarConstraint  # its name until 2026-12 (it runs a pushdown automaton, not an FSM)

__all__ = [
    "ByteDFA", "FSMConstraint", "Grammar", "GrammarBudget", "GrammarConstraint", "GrammarIndex", "apply_token_masks",
    "build_constraint", "compile_grammar", "grammar_to_regex", "json_schema_to_grammar", "regex_to_dfa",
]
