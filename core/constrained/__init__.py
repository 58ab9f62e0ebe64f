"""radixlm.core.constrained: regex, JSON schema and choices -> a grammar of small regex terminals ->
a lazily determinized pushdown automaton -> token masks and jump-forward per request (one engine; the
optional llguidance package behind the same interface). See docs/constrained.md."""

from radixlm.core.constrained.fsm import FSMConstraint, build_constraint
from radixlm.core.constrained.grammar import Grammar
from radixlm.core.constrained.grammar_compiler import GrammarBudget, compile_grammar
from radixlm.core.constrained.json_grammar import json_schema_to_grammar
from radixlm.core.constrained.json_schema import json_schema_to_regex
from radixlm.core.constrained.masks import apply_token_masks
from radixlm.core.constrained.pda import GrammarIndex
from radixlm.core.constrained.regex_dfa import ByteDFA, regex_to_dfa

__all__ = [
    "ByteDFA", "FSMConstraint", "Grammar", "GrammarBudget", "GrammarIndex", "apply_token_masks", "build_constraint",
    "compile_grammar", "json_schema_to_grammar", "json_schema_to_regex", "regex_to_dfa",
]
