"""The one place where constraint specs become live constraints (core.runtime.constrained): the GrammarBudget
built from the engine's options, the schema documents registered, the grammar tables prepared in the
background, and the compile itself.

One per process: the engine shares its own between the front end (which compiles each spec once to
refuse a bad one before anything is queued) and a scheduler on a thread (whose build is then a cache
hit); a scheduler in its own process makes its own, since caches do not cross processes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from radixlm.core.runtime.constrained import GrammarBudget, build_constraint
from radixlm.core.errors import GrammarBudgetError, InvalidRequestError
from radixlm.core.runtime.constraint import TokenConstraint
from radixlm.core.runtime.messages import ConstraintSpec
from radixlm.core.runtime.options import EngineOptions


class ConstraintCompiler:
    def __init__(self, tokenizer: Any, eos_token_ids: list[int], opts: EngineOptions) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.backend = opts.grammar_backend
        self.budget = GrammarBudget(max_compile_seconds=opts.grammar_max_compile_seconds,
                                    max_configs=opts.grammar_max_configs, warm_seconds=opts.grammar_warm_seconds)
        self._prepare_pending = opts.grammar_backend == "radixlm" and opts.grammar_prepare_at_start
        self._prepare_stop: threading.Event | None = None
        if opts.json_schema_documents:  # refs request schemas may name (a bad directory fails the start)
            from radixlm.core.runtime.constrained.schema.schema_refs import register_documents  # imports `referencing`

            register_documents(opts.json_schema_documents)

    def prepare_in_background(self, then: Callable[[], None] | None = None) -> None:
        """Builds the tokenizer's grammar tables on a thread (the first call only, when the options ask
        for it), then calls `then`."""
        if not self._prepare_pending:
            return
        self._prepare_pending = False
        from radixlm.core.runtime.constrained.grammar_index_cache import prepare_in_background

        self._prepare_stop = prepare_in_background(self.tokenizer, self.eos_token_ids, then)

    def close(self) -> None:
        """Stops the background preparation, if it is still running (an engine's shutdown)."""
        if self._prepare_stop is not None:
            self._prepare_stop.set()

    def build(self, spec: ConstraintSpec) -> TokenConstraint:
        """A fresh live constraint for one request. ValueError naming the problem for an invalid spec,
        GrammarBudgetError past a budget."""
        return build_constraint(spec.kind, spec.value(), self.tokenizer, eos_token_ids=self.eos_token_ids,
                                backend=self.backend, budget=self.budget)

    def check(self, specs: Iterable[ConstraintSpec]) -> None:
        """Compiles each distinct spec once, raising the request's error (InvalidRequestError, or
        GrammarBudgetError past a budget) for the first one that fails."""
        for spec in dict.fromkeys(specs):
            try:
                self.build(spec)
            except GrammarBudgetError as e:
                raise GrammarBudgetError(f"invalid {spec.kind}: {e}", spec.kind) from None
            except RecursionError:
                raise InvalidRequestError(f"invalid {spec.kind}: nested too deeply", spec.kind) from None
            except ValueError as e:
                raise InvalidRequestError(f"invalid {spec.kind}: {e}", spec.kind) from None
