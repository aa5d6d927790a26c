"""transformers' GGUF tensor-name mapping at the cost of one name map instead of one per module.

transformers maps a GGUF file's tensor names to its modules' parameter names with ``get_gguf_hf_weights_map``,
which walks the model's modules and, for every one of them, builds gguf-py's ``TensorNameMap`` for the whole
architecture again (``gguf.get_tensor_name_map``: every name pattern of every block formatted, ~30 ms). SmolLM2-135M
has 397 modules: 13 of the 14.6 s its GGUF file took to load went there, on every load. The map depends only on the
architecture and the block count, so inside `shared_name_maps` gguf-py's function returns one map per (architecture,
blocks), built once per process; the mapping transformers computes is the same. gguf-py's own function is back in
place when no load is inside the block.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import gguf

_ORIGINAL = gguf.get_tensor_name_map
_SHARED = functools.cache(_ORIGINAL)
_LOCK = threading.Lock()
_DEPTH = 0  # loads inside the block now (threads may load at once)


@contextlib.contextmanager
def shared_name_maps() -> Iterator[None]:
    """While inside, ``gguf.get_tensor_name_map`` (which transformers imports at each call) returns one shared map
    per (architecture, blocks)."""
    global _DEPTH
    with _LOCK:
        _DEPTH += 1
        gguf.get_tensor_name_map = _SHARED
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                gguf.get_tensor_name_map = _ORIGINAL


__all__ = ["shared_name_maps"]
