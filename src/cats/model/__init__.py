"""The target model: loading (HF folder, Hub id, GGUF), the layered forward and the shared KV cache.

Nothing in this package knows about drafting or speculation: it runs layer ranges on hidden states."""

from cats.model.cache import KVCache
from cats.model.layered import SUPPORTED_MODEL_TYPES, LayeredModel
from cats.model.load import load_model
from cats.model.source import resolve_dtype

__all__ = ["KVCache", "LayeredModel", "SUPPORTED_MODEL_TYPES", "load_model", "resolve_dtype"]
