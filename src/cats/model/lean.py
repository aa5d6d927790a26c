"""Optional `torch.compile` (inductor) of the cache-free parts of every decoder layer.

What is compiled: each layer's MLP and its two norms, the model's own HF modules, left in place with only their
instance ``forward`` pointing at the compiled function (parameter names and objects do not change, so memory
streaming and adapters keep working). All layers share one
compiled graph per input shape (the parameters are graph inputs), so compiling costs seconds, not one compile per
layer. Attention (rotary, the KV cache write, SDPA) stays eager: its cache update depends on the layer index,
which would make dynamo recompile for every layer.

Compilation is opt-in (`compile_layers`, ``--compile``) and falls back to eager: when ``torch.compile`` is
missing or the first compiled call fails (no C++ compiler, an unsupported op), the wrappers switch to the eager
modules for good with a one-line warning. Compiled code may round differently from eager code (fused
reductions), so a compiled model is compared with itself: every speculative method on it reproduces its own
plain greedy decoding token for token.
"""

from __future__ import annotations

import os
import types
import warnings

import torch
from torch import nn

COMPILED_PARTS = ("mlp", "input_layernorm", "post_attention_layernorm")


def _eager(module: nn.Module, *args, **kwargs):
    return type(module).forward(module, *args, **kwargs)


def _lean_forward(module: nn.Module, *args, **kwargs):
    """Instance ``forward`` of a compiled part: the shared compiled function, or eager once compilation failed."""
    lean = module._lean
    if lean["state"].get("failed"):
        return _eager(module, *args, **kwargs)
    try:
        return lean["compiled"](module, *args, **kwargs)
    except Exception as error:  # noqa: BLE001 - any compiler failure means: run eagerly
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        lean["state"]["failed"] = f"{type(error).__name__}: {message}"
        warnings.warn(f"torch.compile failed ({lean['state']['failed']}); running eagerly", RuntimeWarning,
                      stacklevel=2)
        return _eager(module, *args, **kwargs)


def compile_available() -> str | None:
    """None if torch.compile can be tried here, else why not."""
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    if os.environ.get("CATS_NO_COMPILE"):
        return "CATS_NO_COMPILE is set"
    return None


def compile_layers(model, dynamic: bool = True, cache_dir: str | None = None) -> dict:
    """Wrap every decoder layer's MLP and norms of ``model`` (a `LayeredModel`) in compiled parts, in place.

    Returns ``{"compiled": bool, "reason": str | None, "state": ...}``; ``state["failed"]`` is set if a compiled
    call later fails and the parts fell back to eager. ``cache_dir`` (default ``$CATS_CACHE/inductor``) keeps
    inductor's compiled kernels between processes (``TORCHINDUCTOR_CACHE_DIR``)."""
    reason = compile_available()
    if reason is not None:
        warnings.warn(f"not compiling: {reason}", RuntimeWarning, stacklevel=2)
        return {"compiled": False, "reason": reason, "state": {}}
    if getattr(model, "_lean_state", None) is not None:
        return {"compiled": True, "reason": None, "state": model._lean_state}
    if cache_dir is None:
        from cats.model.load import cache_root

        cache_dir = str(cache_root() / "inductor")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir)
    state: dict = {}
    compiled = {part: torch.compile(_eager, dynamic=dynamic) for part in COMPILED_PARTS}
    for layer in model.layers[: model.num_layers]:
        for part in COMPILED_PARTS:
            module = getattr(layer, part)
            # the module stays where it is (parameter names, streaming and adapters see no change); only its
            # instance `forward` dispatches to the shared compiled function
            module._lean = {"compiled": compiled[part], "state": state}
            module.forward = types.MethodType(_lean_forward, module)
    model._lean_state = state
    return {"compiled": True, "reason": None, "state": state}


def uncompile_layers(model) -> None:
    """Put the eager HF modules back (undo `compile_layers`)."""
    for layer in model.layers[: model.num_layers]:
        for part in COMPILED_PARTS:
            module = getattr(layer, part)
            module.__dict__.pop("forward", None)
            module.__dict__.pop("_lean", None)
    model._lean_state = None
