"""Typed exceptions. Every user error raised by the API is a `CatsError`; the CLI prints its message
on one line (no traceback) and exits with status 2."""


class CatsError(Exception):
    """Base class of all errors CATS raises for bad input or a missing resource."""


class ModelNotFoundError(CatsError):
    """The model path does not exist and is not a reachable Hugging Face Hub id."""


class MissingDependencyError(CatsError):
    """An optional package needed for this input is not installed."""


class UnsupportedArchitectureError(CatsError):
    """The model's architecture is not one CATS can drive layer by layer."""


class PromptTooLongError(CatsError):
    """The prompt does not fit into the model's context window."""


class InvalidArgumentError(CatsError, ValueError):
    """A generation or CLI argument is out of range."""


class UnknownMethodError(InvalidArgumentError):
    """A decoding method name that CATS does not know."""
