"""CATS: Cascaded Adaptive Tree Speculation.

Lossless self-speculative decoding for Hugging Face causal LMs: virtual draft models are made from the target
itself (early exit, prompt lookup, ...), the full target verifies every token.

    import cats
    model = cats.load("HuggingFaceTB/SmolLM2-135M-Instruct")
    result = cats.generate(model, "Tell me a story.", method="pld", chat=True, max_new_tokens=64)
    print(result.text, result.stats.tokens_per_s)
"""

from cats.errors import (
    CatsError,
    InvalidArgumentError,
    MissingDependencyError,
    ModelNotFoundError,
    PromptTooLongError,
    UnknownMethodError,
    UnsupportedArchitectureError,
)
from cats.generate import GenerationConfig, GenerationResult, Generator, generate
from cats.model import LayeredModel, load_model
from cats.stats import GenerationStats

load = load_model

__all__ = [
    "CatsError", "InvalidArgumentError", "MissingDependencyError", "ModelNotFoundError", "PromptTooLongError",
    "UnknownMethodError", "UnsupportedArchitectureError", "GenerationConfig", "GenerationResult", "Generator",
    "GenerationStats", "LayeredModel", "generate", "load", "load_model",
]
__version__ = "0.1.0"
