"""radixlm.core.constrained: regex and JSON schema -> byte-level DFA -> token index -> per-request
constraints with jump-forward (the compressed FSM). See docs/constrained.md."""

from radixlm.core.constrained.fsm import FSMConstraint, build_constraint, constraint_regex
from radixlm.core.constrained.index import TokenIndex, get_index
from radixlm.core.constrained.json_schema import json_schema_to_regex
from radixlm.core.constrained.masks import apply_token_masks
from radixlm.core.constrained.regex_dfa import ByteDFA, regex_to_dfa

__all__ = [
    "ByteDFA", "FSMConstraint", "TokenIndex", "apply_token_masks", "build_constraint", "constraint_regex",
    "get_index", "json_schema_to_regex", "regex_to_dfa",
]
