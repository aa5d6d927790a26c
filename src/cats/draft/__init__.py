"""Virtual draft models made from the target itself, one module each, and the method registry."""

from __future__ import annotations

from collections.abc import Sequence

from cats.draft.base import DecodeState, Draw, Drafter, Proposal
from cats.draft.early_exit import EarlyExitDrafter, default_draft_layer
from cats.draft.layer_skip import LayerSkipDrafter, SkipSet
from cats.draft.prompt_lookup import PromptLookupDrafter
from cats.draft.tree_draft import TreeDrafter
from cats.errors import InvalidArgumentError, UnknownMethodError
from cats.memory.speculation import speculation_for
from cats.model import LayeredModel

METHODS = ("ar", "pld", "early-exit", "tree", "cats", "cats-no-shallow", "layer-skip", "dytc", "eagle", "recycle")
# cats = draft adapter + dynamic tree + shallow-verifier cascade; cats-no-shallow ablates the cascade;
# layer-skip = the target with calibrated sublayers skipped; dytc = a scheduler over prompt lookup, layer-skip
# drafters in a vertical cascade and (with --adapters) the draft adapter; eagle = trees from the feature draft
# adapter (EAGLE-style: reads the target's final features, runs no target layer while drafting); recycle = token
# recycling (training-free trees from a table of the target's own recent candidates, no model call)
LAYER_SKIP_SPARSITY = 0.4
DYTC_SPARSITIES = (0.4, 0.6)


def _draft_adapter(adapters: str | None, model: LayeredModel, early_exit: bool = False):
    """The draft adapter of an adapters folder (``DIR/draft/``, or DIR itself); for early exit its own
    ``DIR/early-exit/`` (an early-exit feature adapter, input ``features+hidden``) when there is one."""
    if adapters is None:
        return None
    from cats.draft.adapter import find_draft_adapter, load_adapter

    return load_adapter(find_draft_adapter(adapters, early_exit), model, role="draft")


def _feature_adapter(adapters: str | None, model: LayeredModel):
    """The feature draft adapter of an adapters folder (``DIR/feature/``, or DIR itself when it is one), else None."""
    import json
    from pathlib import Path

    from cats.draft.adapter import AdapterError, find_adapter, load_adapter

    if adapters is None:
        return None
    try:
        folder = find_adapter(adapters, "feature")
        if folder == Path(adapters) and json.loads((folder / "config.json").read_text()).get("input") != "features":
            return None  # DIR itself is an adapter of another kind
    except (AdapterError, ValueError):
        return None
    return load_adapter(folder, model, role="draft", layer=model.num_layers)


def _check_resident(model: LayeredModel, layer: int) -> None:
    """Under a memory budget the draft layers must be resident (an out-of-range layer is the drafter's error)."""
    from cats.memory.offload import check_resident

    if 1 <= layer < model.num_layers:
        check_resident(model, layer, f"drafting from layer {layer}")


def check_method(method: str) -> str:
    """Return ``method`` if CATS knows it, else raise `UnknownMethodError` listing the known ones."""
    if method not in METHODS:
        raise UnknownMethodError(f"unknown method {method!r}; known methods: {', '.join(METHODS)}")
    return method


# The default confidence stop (``--threshold``) of the adapter drafters: a chain stops before a token whose draft
# probability is below it, a tree stops expanding when its best path's is. Chosen by measurement on SmolLM2, bf16
# and float32 (docs/benchmarks.md, "Confidence stop"): a draft pass costs ~0.1 of a forward, so an unlikely token
# costs more than it earns; 0.4 and 0.6 measured alike, 0 (always draft the full length) was the slowest. Under a
# memory budget it measured better than 0 at 110 % and the same at 50 % (float32).
CONFIDENCE_STOP = 0.4
CONFIDENCE_STOP_METHODS = ("early-exit", "eagle", "tree", "cats", "cats-no-shallow")


def make_drafter(
    method: str,
    model: LayeredModel,
    num_draft_tokens: int | None = None,
    draft_layer: int | None = None,
    max_ngram: int = 3,
    adapters: str | None = None,
    threshold: float | None = None,
    tree_topk: int | None = None,
    total_tokens: int | None = None,
    depth: int | None = None,
    sparsity: float | Sequence[float] | None = None,
    progress: bool = True,
) -> Drafter | None:
    """The drafter for a method name; ``None`` for plain autoregressive decoding (``ar``).

    ``adapters``: a folder with trained adapters (``DIR/draft/`` or an adapter folder itself); early exit and
    trees then draft through the draft adapter at its own layer (early exit through ``DIR/early-exit/``, an
    adapter that also reads the target's final features, when there is one). ``threshold``: their confidence stop;
    None: `CONFIDENCE_STOP` for early-exit, eagle, tree and cats (also under a memory budget), none (0) for
    layer-skip.
    ``tree_topk``, ``total_tokens``, ``depth``: the shape of dynamic draft trees (method ``tree``).
    ``sparsity``: layer-skip's fraction of skipped sublayers (default 0.4), or dytc's list of them (default 0.4,
    0.6); skip sets come from the calibration cache, calibrated on first use (`cats.draft.calibrate`; ``progress``:
    with a progress bar on stderr).

    Left as None, the early-exit draft length and the tree shape are 4 and (4, 16, 5); when the model streams
    layers under a memory budget they come from the speculation bucket chosen for the budget's I/O cost
    (`cats.memory.speculation`). layer-skip and dytc draft through every layer, so they refuse a model that
    streams layers."""
    check_method(method)
    if threshold is None:
        threshold = CONFIDENCE_STOP if method in CONFIDENCE_STOP_METHODS else 0.0
    if method in ("layer-skip", "dytc") and model.weights is not None:
        raise InvalidArgumentError(f"{method} drafts through every layer, so under a memory budget every draft token "
                                   "would read the streamed layers again; it needs a budget that keeps every layer "
                                   "resident (or use tree, cats, early-exit or pld)")
    if sparsity is not None and method not in ("layer-skip", "dytc"):
        raise InvalidArgumentError(f"--sparsity applies to layer-skip and dytc, not to {method!r}")
    if method == "layer-skip" and adapters is not None:
        raise InvalidArgumentError("--adapters does not apply to layer-skip (it needs no training); use dytc to "
                                   "combine layer skipping with the draft adapter")
    if method == "dytc" and threshold:
        raise InvalidArgumentError("--threshold does not apply to dytc: the scheduler chooses draft lengths itself")
    if method == "layer-skip":
        values = _sparsities(sparsity, (LAYER_SKIP_SPARSITY,))
        if len(values) != 1:
            raise InvalidArgumentError(f"layer-skip takes one sparsity, got {', '.join(map(str, values))}")
        return make_layer_skip(model, values[0], num_tokens=num_draft_tokens or 4, threshold=threshold,
                               progress=progress)
    if method == "dytc":
        from cats.draft.dytc import make_dytc

        bucket = speculation_for(model)[0]  # the default shape: nothing streams here
        feature = _feature_adapter(adapters, model)  # a feature/ adapter in DIR is used instead of draft/
        return make_dytc(model, _sparsities(sparsity, DYTC_SPARSITIES), feature_adapter=feature,
                         adapter=_draft_adapter(adapters, model) if feature is None else None,
                         max_ngram=max_ngram, num_tokens=num_draft_tokens,
                         tree_topk=bucket.tree_topk if tree_topk is None else tree_topk,
                         total_tokens=bucket.total_tokens if total_tokens is None else total_tokens,
                         depth=bucket.depth if depth is None else depth, progress=progress)
    if method == "eagle":
        return make_feature_drafter(model, adapters, num_draft_tokens, draft_layer, threshold, tree_topk,
                                    total_tokens, depth)
    if method in ("cats", "cats-no-shallow") and adapters is None:
        raise InvalidArgumentError(f"method {method!r} needs --adapters DIR holding trained draft/ and shallow/ adapters "
                                   "(cats train adapter); without adapters use tree or early-exit")
    if method in ("ar", "pld", "recycle") and (adapters is not None or threshold):
        raise InvalidArgumentError(f"--adapters and --threshold apply to early-exit and tree drafting, not to {method!r}")
    if method == "recycle":
        from cats.draft.recycle import DEPTH, TOTAL_TOKENS, TokenRecyclingDrafter

        if num_draft_tokens is not None or draft_layer is not None or tree_topk is not None:
            raise InvalidArgumentError("recycle drafts trees from a table (8 candidates per token): its shape is "
                                       "--total-tokens and --depth; --num-draft-tokens, --draft-layer and --tree-topk "
                                       "do not apply")
        return TokenRecyclingDrafter(model.vocab_size, total_tokens=total_tokens or TOTAL_TOKENS, depth=depth or DEPTH)
    if method == "ar":
        return None
    if method == "pld":
        return PromptLookupDrafter(num_tokens=num_draft_tokens or 10, max_ngram=max_ngram)
    adapter = _draft_adapter(adapters, model, early_exit=method == "early-exit")
    layer = adapter.config.layer if adapter is not None else draft_layer
    _check_resident(model, default_draft_layer(model) if layer is None else layer)
    chosen = None  # (bucket, why) when the budget chose the draft size
    if method == "early-exit":
        if num_draft_tokens is None:
            chosen = speculation_for(model, chain=True)
            num_draft_tokens = chosen[0].num_draft_tokens
        drafter = EarlyExitDrafter(model, layer=draft_layer, num_tokens=num_draft_tokens, adapter=adapter,
                                   threshold=threshold)
    elif method in ("tree", "cats", "cats-no-shallow"):
        if None in (tree_topk, total_tokens, depth):
            chosen = speculation_for(model)
            tree_topk = chosen[0].tree_topk if tree_topk is None else tree_topk
            total_tokens = chosen[0].total_tokens if total_tokens is None else total_tokens
            depth = chosen[0].depth if depth is None else depth
        drafter = TreeDrafter(model, layer=draft_layer, adapter=adapter, tree_topk=tree_topk,
                              total_tokens=total_tokens, depth=depth, threshold=threshold)
    else:
        raise AssertionError(f"method {method!r} is listed in METHODS but has no drafter")
    if chosen is not None and model.memory_plan is not None:
        drafter.speculation = chosen[1]
    return drafter


def make_feature_drafter(model: LayeredModel, adapters: str | None, num_draft_tokens: int | None = None,
                         draft_layer: int | None = None, threshold: float = 0.0, tree_topk: int | None = None,
                         total_tokens: int | None = None, depth: int | None = None):
    """The eagle drafter: the feature adapter of ``adapters`` (``DIR/feature/`` or an adapter folder itself)."""
    from cats.draft.adapter import find_adapter, load_adapter
    from cats.draft.feature import FeatureDrafter

    if adapters is None:
        raise InvalidArgumentError("method 'eagle' needs --adapters DIR holding a trained feature/ adapter "
                                   "(cats train adapter --input features)")
    if num_draft_tokens is not None or draft_layer is not None:
        raise InvalidArgumentError("eagle drafts from the target's final features: --draft-layer does not apply, and "
                                   "its draft length is --depth (a chain: --tree-topk 1)")
    adapter = load_adapter(find_adapter(adapters, "feature"), model, role="draft", layer=model.num_layers)
    shape = {key: value for key, value in (("tree_topk", tree_topk), ("total_tokens", total_tokens), ("depth", depth))
             if value is not None}  # the rest: FeatureDrafter's defaults
    return FeatureDrafter(model, adapter, threshold=threshold, **shape)


def _sparsities(value: float | Sequence[float] | None, default: tuple[float, ...]) -> tuple[float, ...]:
    if value is None:
        return default
    values = (value,) if isinstance(value, (int, float)) else tuple(value)
    if not values:
        raise InvalidArgumentError("--sparsity is empty")
    for v in values:
        if not 0.0 < float(v) < 1.0:
            raise InvalidArgumentError(f"sparsity must lie in (0, 1), got {v}")
    if len(set(values)) != len(values):
        raise InvalidArgumentError(f"--sparsity repeats a value: {', '.join(map(str, values))}")
    return tuple(float(v) for v in values)


def make_layer_skip(model: LayeredModel, sparsity: float, num_tokens: int = 4, threshold: float = 0.0,
                    assist: Drafter | None = None, progress: bool = True) -> LayerSkipDrafter:
    """A layer-skip drafter with the model's cached (or newly calibrated) skip set at ``sparsity``."""
    from cats.draft.calibrate import load_or_calibrate

    result = load_or_calibrate(model, sparsity, progress=progress)
    return LayerSkipDrafter(model, result.skip, num_tokens=num_tokens, assist=assist, threshold=threshold,
                            sparsity=sparsity, agreement=result.agreement)


__all__ = [
    "DecodeState", "Draw", "Drafter", "EarlyExitDrafter", "LayerSkipDrafter", "METHODS", "PromptLookupDrafter",
    "Proposal", "SkipSet", "TreeDrafter", "check_method", "default_draft_layer", "make_drafter", "make_layer_skip",
]
