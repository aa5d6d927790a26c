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


class DamagedFileError(CatsError):
    """A model or adapter file that is truncated, empty, not of its format or missing tensors. The message names
    the file, what is wrong with it and the fix; ``path``, ``fault`` and ``fix`` hold the three parts."""

    def __init__(self, path, fault: str = "is damaged", fix: str = "re-download it"):
        super().__init__(f"{path} {fault}; {fix}")
        self.path, self.fault, self.fix = path, fault, fix

    def __reduce__(self):
        return type(self), (self.path, self.fault, self.fix)


class NoTokenizerError(InvalidArgumentError):
    """Text was given to a model without a tokenizer CATS can read (token ids work through the Python API);
    ``model`` names the model."""

    def __init__(self, message: str, model=None):
        super().__init__(message)
        self.model = model

    def __reduce__(self):
        return type(self), (str(self), self.model)
