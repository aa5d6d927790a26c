"""The lean CPU forward's optional parts, each applied in place to a `LayeredModel`'s own HF modules (only an
instance ``forward`` is redirected: parameter names and objects do not change, so memory streaming and adapters keep
working).

* `pack_linears` (``--pack-weights``, bf16 or float32): the linears run on packed copies of their weights, on the
  row-invariant AVX-512 kernels of `cats.model.kernels.avx512` where they run, else on oneDNN (bf16: the same outputs as
  aten's; float32: equal up to the last bits, see below); the kernels' outputs differ from both in the last bits.
  The copies are extra memory, so packing is refused under a memory budget, see `check_packing`.
* `compile_layers` (API only; slower in every configuration measured, see docs/performance.md): `torch.compile`
  (inductor) of each layer's MLP and its two norms. All layers share one compiled graph per input shape (the
  parameters are graph inputs), so compiling costs seconds, not one compile per layer. Attention (rotary, the KV
  cache write, SDPA) stays eager: its cache update depends on the layer index, which would make dynamo recompile
  for every layer. It falls back to eager: when ``torch.compile`` is missing or the first compiled call fails (no
  C++ compiler, an unsupported op), the wrappers switch to the eager modules for good with a one-line warning.
  Compiled code may round differently from eager code (fused reductions), so a compiled model is compared with
  itself: every speculative method on it reproduces its own plain greedy decoding token for token.
"""
from __future__ import annotations

import contextlib
import os
import types
import warnings
import weakref

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from cats.errors import InvalidArgumentError
from cats.model.kernels import avx512
from cats.paths import cache_root

COMPILED_PARTS = ("mlp", "input_layernorm", "post_attention_layernorm")


def _eager(module: nn.Module, *args, **kwargs):
    return type(module).forward(module, *args, **kwargs)


def _lean_forward(module: nn.Module, *args, **kwargs):
    """Instance ``forward`` of a compiled part: the shared compiled function, or eager once compilation failed."""
    lean = module._lean
    if lean["state"].get("failed") or lean["state"].get("off"):
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
    call later fails and the parts fell back to eager; setting ``state["off"] = True`` runs them eagerly (A/B
    timing in one process). ``cache_dir`` (default ``$CATS_CACHE/inductor``) keeps
    inductor's compiled kernels between processes (``TORCHINDUCTOR_CACHE_DIR``)."""
    reason = compile_available()
    if reason is not None:
        warnings.warn(f"not compiling: {reason}", RuntimeWarning, stacklevel=2)
        return {"compiled": False, "reason": reason, "state": {}}
    if getattr(model, "_lean_state", None) is not None:
        return {"compiled": True, "reason": None, "state": model._lean_state}
    if cache_dir is None:

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
    model.lean_before_compile, model.lean = model.lean, False  # the lean layer forward would bypass the parts
    return {"compiled": True, "reason": None, "state": state}


def uncompile_layers(model) -> None:
    """Put the eager HF modules back (undo `compile_layers`)."""
    for layer in model.layers[: model.num_layers]:
        for part in COMPILED_PARTS:
            module = getattr(layer, part)
            module.__dict__.pop("forward", None)
            module.__dict__.pop("_lean", None)
    model._lean_state = None
    model.lean = getattr(model, "lean_before_compile", model.lean)


# ---------------------------------------------------------------------------------------------------------------
# Prepacked linears (oneDNN): the projections are ~2/3 of a layer's time, and aten's bf16 matmul reads the
# weights at about half the speed of oneDNN's blocked layout on this kind of CPU; aten's float32 matmul is 1.7x
# slower at one row and 2.8x slower at 16 rows (docs/performance.md). bf16 outputs are the same as aten's (measured
# max diff 0 on SmolLM2 shapes at M = 1 and 16); float32 outputs differ from aten's in the last bits (~1e-6: another
# summation order), so a packed float32 model reproduces its own plain decoding, not transformers' bit for bit. The
# price is a second, packed copy of each weight.
#
# Where the AVX-512 kernels of `cats.model.kernels.avx512` run (x86-64 Linux with AVX-512 and a C compiler), packed
# linears run on them instead: never slower than oneDNN (1.6x for one bf16 token, 1.4-2.2x for 1-16 float32 tokens),
# and row-invariant. Their packed copy is the only one made then (oneDNN's copies are made on first use only).

PACKED_DTYPES = (torch.bfloat16, torch.float32)


PACKING = {"off": False}  # set "off" to run packed linears eagerly (A/B timing in one process)
_PACKED = WeakIdKeyDictionary()  # weight tensor -> ((data_ptr, version), packed copy), for weights outside a module
# (a packed module keeps its copy in ``module.__dict__["_packed"]``, a fused group in its first module's "_fused")
_PANEL = WeakIdKeyDictionary()  # the same for the AVX-512 kernels' copies ("_panel" and "_fused_panel" in modules)
LAYER_SPECS = weakref.WeakKeyDictionary()  # decoder layer -> its whole-layer kernel spec (`lean_layer._layer_spec`):
# kept outside the module, which adapters deep-copy (a ctypes struct of pointers cannot be copied); modules hash by
# identity, and this C-backed lookup costs a tenth of torch's WeakIdKeyDictionary's (looked up per layer and forward)


@contextlib.contextmanager
def packing_off():
    """Run packed linears through aten's plain ``nn.Linear`` path meanwhile (e.g. the transformers baselines of
    ``cats bench``, which share the model's modules and must run as transformers runs them)."""
    saved = PACKING["off"]
    PACKING["off"] = True
    try:
        yield
    finally:
        PACKING["off"] = saved


def _weight_key(weight: torch.Tensor) -> tuple:
    """What identifies a weight's contents: its storage and (outside inference mode) its version counter."""
    # an inference tensor has no version counter (asking raises, which costs more than this check)
    return weight.data_ptr(), None if weight.is_inference() else weight._version


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def _packed_copy(store, slot, weight: torch.Tensor) -> torch.Tensor:
    """The packed copy of ``weight`` kept in ``store[slot]`` (``_PACKED`` by weight, or a module's ``__dict__``),
    made on first use and again whenever the weight changed."""
    key = _weight_key(weight)
    entry = store.get(slot)
    if entry is None or entry[0] != key:
        entry = store[slot] = (key, _pack(weight))
    return entry[1]


def _panel_copy(store, slot, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """``(key, panel copy of weight, float32 bias or None)`` for the AVX-512 kernels, kept in
    ``store[slot]`` as `_packed_copy` keeps oneDNN's, made again whenever the weight or the bias changed."""
    key = (_weight_key(weight), None if bias is None else _weight_key(bias))
    entry = store.get(slot)
    if entry is None or entry[0] != key:
        entry = store[slot] = (key, avx512.pack(weight),
                               None if bias is None else bias.detach().to(torch.float32).contiguous())
    return entry


def packed_linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(hidden, weight, bias)`` through a packed copy of ``weight`` (bf16 or float32): the AVX-512
    kernels' where they run, else oneDNN's; packed on first use and again whenever the weight changes (loaded,
    trained, streamed)."""
    if PACKING["off"] or weight.dtype not in PACKED_DTYPES or hidden.dtype != weight.dtype:
        return nn.functional.linear(hidden, weight, bias)
    if avx512.usable(hidden, weight):
        _, panels, bias32 = _panel_copy(_PANEL, weight, weight, bias)
        return avx512.linear(hidden, panels, weight.shape[0], bias32)
    return torch.ops.mkldnn._linear_pointwise(hidden, _packed_copy(_PACKED, weight, weight), bias, "none", [], "")


def is_packed(module: nn.Module) -> bool:
    """Whether ``module`` (an ``nn.Linear``) runs through a packed copy of its weight (see `pack_linears`)."""
    return getattr(vars(module).get("forward"), "__func__", None) is _packed_linear_forward


def fused_linear(hidden: torch.Tensor, modules) -> torch.Tensor | None:
    """The outputs of ``modules`` (``nn.Linear``s reading the same input, e.g. q, k and v) side by side, from one
    GEMM on a prepacked copy of their concatenated weights, when every one of them is packed (`pack_linears`) and
    packing is on; None otherwise (the caller runs them one by one). The fused copy (kept by the first module)
    replaces their separate packed copies (those are made on first use only) and is made again whenever one of the
    weights changes. (Called for every layer of every forward: the checks are kept to plain dict lookups.)"""
    weight = modules[0]._parameters.get("weight")
    if PACKING["off"] or weight is None:  # no float weight: e.g. linears on GGUF blocks, each its own call
        return None
    panel = avx512.usable(hidden, weight)
    entry = fused_copy(modules, hidden.dtype, panel)
    if entry is None:
        return None
    if panel:
        return avx512.linear(hidden, entry[1], sum(module.out_features for module in modules), entry[2])
    return torch.ops.mkldnn._linear_pointwise(hidden, entry[1], entry[2], "none", [], "")


def fused_copy(modules, dtype: torch.dtype, panel: bool) -> tuple | None:
    """``(key, packed weight, bias)`` of ``modules``' concatenated weights (see `fused_linear`): the AVX-512 kernels'
    panels and a float32 bias (``panel``), else oneDNN's copy; kept by the first module, made again whenever a weight
    changed; None if a module is not packed or the weights are not ``dtype``."""
    weights = [module._parameters["weight"] for module in modules]
    key = [_weight_key(weight) for weight in weights]
    slot = "_fused_panel" if panel else "_fused"
    entry = modules[0].__dict__.get(slot)  # only packed modules get one (`unpack_linears` drops it)
    if entry is None or entry[0] != key:
        if not all(is_packed(module) for module in modules) or dtype != weights[0].dtype:
            return None
        bias = None
        if any(module.bias is not None for module in modules):
            bias = torch.cat([module.bias.detach() if module.bias is not None else
                              module.weight.new_zeros(module.out_features) for module in modules])
        weight = torch.cat([w.detach() for w in weights])
        if panel:
            entry = (key, avx512.pack(weight), None if bias is None else bias.to(torch.float32))
        else:
            entry = (key, _pack(weight), bias)
        modules[0].__dict__[slot] = entry
    return entry


def panel_copy(module: nn.Linear) -> tuple:
    """``(key, panels, float32 bias or None)`` of a packed ``module`` for the AVX-512 kernels (the copy its forward
    uses, made again whenever its weight or bias changed)."""
    return _panel_copy(module.__dict__, "_panel", module._parameters["weight"], module._parameters["bias"])


def _packed_linear_forward(module: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """A packed module's ``forward``: its packed copy is kept in the module (cheaper to find than by weight)."""
    weight, bias = module._parameters["weight"], module._parameters["bias"]
    if PACKING["off"] or hidden.dtype != weight.dtype:
        return nn.functional.linear(hidden, weight, bias)
    if avx512.usable(hidden, weight):
        _, panels, bias32 = _panel_copy(module.__dict__, "_panel", weight, bias)
        return avx512.linear(hidden, panels, weight.shape[0], bias32)
    return torch.ops.mkldnn._linear_pointwise(hidden, _packed_copy(module.__dict__, "_packed", weight), bias, "none",
                                              [], "")


def pack_module(module: nn.Module) -> int:
    """Route every ``nn.Linear`` inside ``module`` through `packed_linear`; returns how many are packed."""
    count = 0
    for inner in module.modules():
        if type(inner) is not nn.Linear:
            continue
        if "forward" not in vars(inner):
            inner.forward = types.MethodType(_packed_linear_forward, inner)
        count += is_packed(inner)
    return count


def pack_available(dtype: torch.dtype) -> str | None:
    """None if prepacked linears can run for ``dtype`` here, else why not."""
    if dtype not in PACKED_DTYPES:
        return f"prepacking is for bfloat16 and float32 weights, not {dtype}"
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return "this torch has no oneDNN linear"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no oneDNN bf16 support"
    return None


def check_packing(dtype: torch.dtype, memory_budget) -> None:
    """Refuse ``--pack-weights`` where it cannot work: a dtype other than bf16 or float32 (or no oneDNN / no oneDNN
    bf16 here), or a memory budget, whose plan does not count the packed copies."""

    if memory_budget is not None:
        raise InvalidArgumentError("--pack-weights (pack_weights) keeps a second, packed copy of the resident "
                                   "weights, which a memory budget does not plan for; drop one of the two")
    reason = pack_available(dtype)
    if reason is not None:
        raise InvalidArgumentError(f"cannot pack the weights (--pack-weights): {reason}; use --dtype bfloat16 or "
                                   "float32, or drop --pack-weights")


def pack_linears(model, head: bool = True) -> dict:
    """Route every ``nn.Linear`` of the resident decoder layers of ``model`` (and, with ``head``, its lm_head)
    through a oneDNN-prepacked copy of its weight (bf16 or float32; the HF modules and their parameters stay as they
    are, the packed copies are extra memory: about the size of the packed weights). Adapters loaded onto the model
    pack their own block and head rows on first use (``model.packed``). Layers streamed under a memory budget are
    skipped (their weights come and go; a packed copy would defeat the budget).

    Returns ``{"packed": number of linears, "reason": why none were packed or None}``."""
    reason = pack_available(model.dtype)
    if reason is not None:
        return {"packed": 0, "reason": reason}
    count = sum(pack_module(layer) for i, layer in enumerate(model.layers)
                if model.weights is None or not model.weights.is_streamed(i))
    if head and type(model.hf_model.lm_head) is nn.Linear:
        count += pack_module(model.hf_model.lm_head)
    model.packed = count > 0
    return {"packed": count, "reason": None if count else "no resident layers"}


def unpack_linears(model) -> None:
    """Undo `pack_linears` (frees the packed copies)."""
    for module in [*model.layers[: model.num_layers], model.hf_model.lm_head]:
        for inner in module.modules():
            if is_packed(inner):
                for name in ("forward", "_packed", "_fused", "_panel", "_fused_panel"):
                    inner.__dict__.pop(name, None)
        LAYER_SPECS.pop(module, None)
    model.packed = False
