"""CATS: Cascaded Adaptive Tree Speculation.

Lossless self-speculative decoding for local LLMs: virtual draft models are made from the target itself (early exit,
prompt lookup, layer skipping, ...), and the full target verifies every token.

    import cats
    model = cats.load("path/to/model.gguf")
    result = cats.generate(model, "Tell me a story.", method="pld", chat=True,
                           generation=cats.GenerationConfig(max_new_tokens=64))
    print(result.text, result.stats.tokens_per_s)
"""

from cats.api import generate, load, stream
from cats.config import DraftConfig, GenerationConfig, KernelConfig, MemoryConfig
from cats.errors import (
    CatsError,
    InvalidArgumentError,
    MissingDependencyError,
    ModelNotFoundError,
    PromptTooLongError,
    UnknownMethodError,
    UnsupportedArchitectureError,
)
from cats.loop.generator import GenerationResult, Generator
from cats.loop.stats import GenerationStats
from cats.methods import METHODS
from cats.model import LayeredModel, load_model

__all__ = [
    "CatsError", "DraftConfig", "GenerationConfig", "GenerationResult", "GenerationStats", "Generator",
    "InvalidArgumentError", "KernelConfig", "LayeredModel", "METHODS", "MemoryConfig", "MissingDependencyError",
    "ModelNotFoundError", "PromptTooLongError", "UnknownMethodError", "UnsupportedArchitectureError", "generate",
    "load", "load_model", "stream",
]
__version__ = "0.1.0"
