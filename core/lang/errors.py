"""Errors of the program model, in the project's one hierarchy (radixlm.core.errors)."""

from radixlm.core.errors import RadixLMError


class ProgramError(RadixLMError, RuntimeError):
    """A program's state failed: a backend call raised, or a variable was never produced."""


class TracingError(RadixLMError, TypeError):
    """A program cannot be traced without a model: it branches on, converts or formats a value that
    only exists at run time (a generated variable or an unbound argument)."""
