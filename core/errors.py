"""The one small exception hierarchy. Invalid input raises a ValueError subclass, so callers that
catch ValueError (and the server, which maps it to HTTP 400) treat every kind of bad request alike."""


class RadixLMError(Exception):
    """Base of every error radixlm raises on purpose."""


class InvalidRequestError(RadixLMError, ValueError):
    """The caller sent something invalid: an unknown or out-of-range field, a prompt too long, ..."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class TooComplexError(InvalidRequestError):
    """Preparing the request (tokenizing, compiling its constraint) ran past the engine's time budget."""


class UnsupportedModelError(RadixLMError, ValueError):
    """The checkpoint's architecture or configuration is not one radixlm can run."""


class OutOfMemoryError(RadixLMError, RuntimeError):
    """KV memory cannot hold even one request of this size, however much is evicted or retracted."""


class EngineShutdownError(RadixLMError, RuntimeError):
    """The engine was shut down before the request finished."""


class EngineDeadError(EngineShutdownError):
    """The engine's scheduler died (its loop raised outside any request, or its process was killed)."""


class QueueFullError(RadixLMError, RuntimeError):
    """The engine's bounded queue is full; retry later (the server answers 503 with retry-after)."""


class GrammarBudgetError(TooComplexError):
    """Compiling a constraint's grammar would pass a budget (compile time, automaton states); the budgets
    are options of core.runtime.constrained.automata.grammar_compiler.GrammarBudget."""


class ModelNotFoundError(RadixLMError, FileNotFoundError):
    """The model path is neither a local file or folder nor a hub id that resolves (cache or download)."""
