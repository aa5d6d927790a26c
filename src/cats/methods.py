"""The method registry: every decoding method CATS knows, in one place.

A `Method` says what a method is to every part of CATS: how its drafter is made (``make``), which `DraftConfig`
settings apply to it (the rest are refused, never ignored), what it needs resident under a memory budget
(``needs``), whether the shallow verifier's cascade scores its drafts, and the one line the CLI, ``cats bench`` and
``cats serve`` show for it. Adding a method: its drafter in ``cats/draft/``, one entry in `METHODS`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from cats.config import DraftConfig
from cats.draft.base import Drafter
from cats.draft.dytc import make_dytc
from cats.draft.eagle import FeatureDrafter
from cats.draft.early_exit import EarlyExitDrafter, default_draft_layer
from cats.draft.layer_skip.calibration import load_or_calibrate
from cats.draft.layer_skip.drafter import NUM_TOKENS as LAYER_SKIP_TOKENS
from cats.draft.layer_skip.drafter import LayerSkipDrafter
from cats.draft.layer_skip.stream_order import streamed_skip
from cats.draft.prompt_lookup import PromptLookupDrafter
from cats.draft.recycle import DEPTH as RECYCLE_DEPTH
from cats.draft.recycle import TOTAL_TOKENS as RECYCLE_TOKENS
from cats.draft.recycle import TokenRecyclingDrafter
from cats.draft.sizing import speculation_for
from cats.draft.tree import TreeDrafter
from cats.errors import InvalidArgumentError, UnknownMethodError
from cats.model import LayeredModel
from cats.model.adapter import (
    AdapterError,
    find_adapter,
    find_draft_adapter,
    load_adapter,
)
from cats.model.eagle3 import find_eagle3_folder, load_eagle3_head
from cats.model.weights.budget import (
    DEFAULT_CONTEXT_TOKENS,
    DEFAULT_PREFETCH,
    MemoryNeeds,
)
from cats.method_needs import (
    HeldAs,
    cats_needs,
    dytc_eagle3_folder,
    dytc_needs,
    eagle3_needs,
    eagle_needs,
    early_exit_needs,
    layer_skip_needs,
    layer_skip_shape,
    no_needs,
    pld_needs,
    recycle_needs,
    tree_needs,
)
from cats.model.weights.offload import check_resident
from cats.model.weights.transient import PROMPT_CHUNK
from cats.verify.cascade import make_cascade
from cats.verify.scorer import TargetScorer

LAYER_SKIP_SPARSITY = 0.4
DYTC_SPARSITIES = (0.4, 0.6)

# The default confidence stop (``--threshold``) of the adapter drafters: a chain stops before a token whose draft
# probability is below it, a tree stops expanding when its best path's is. Chosen by measurement on SmolLM2, bf16
# and float32 (docs/benchmarks.md): a draft pass costs ~0.1 of a forward, so an unlikely token costs more than it
# earns; 0.4 and 0.6 measured alike, 0 (always draft the full length) was the slowest. Under a memory budget it
# measured better than 0 at 110 % and the same at 50 % (float32).
CONFIDENCE_STOP = 0.4



@dataclass(frozen=True)
class Method:
    name: str
    summary: str  # one line: CLI help, bench and server listings
    make: Callable[[LayeredModel, DraftConfig, float, bool], Drafter | None]  # (model, drafting, threshold, progress)
    needs: Callable[[MemoryNeeds, object, HeldAs, DraftConfig], None]  # fills what it needs under a budget
    settings: frozenset[str] = frozenset()  # the DraftConfig fields that apply
    threshold: float = 0.0  # the default confidence stop
    cascade: bool = False  # scored through the shallow verifier's cascade


# ----------------------------------------------------------------------------------------------- drafters
def _draft_adapter(adapters: str | None, model: LayeredModel, early_exit: bool = False):
    """The draft adapter of an adapters folder (``DIR/draft/``, or DIR itself); for early exit its own
    ``DIR/early-exit/`` (an early-exit feature adapter, input ``features+hidden``) when there is one."""
    if adapters is None:
        return None
    return load_adapter(find_draft_adapter(adapters, early_exit), model, role="draft")


def _feature_adapter(adapters: str | None, model: LayeredModel):
    """The feature drafter's head of an adapters folder for dytc: its EAGLE-3 head (`dytc_eagle3_folder`), else
    its feature draft adapter (``DIR/feature/``, or DIR itself when it is one), else None."""
    if adapters is None:
        return None
    if (eagle3 := dytc_eagle3_folder(adapters)) is not None:
        return load_eagle3_head(eagle3, model)
    try:
        folder = find_adapter(adapters, "feature")
        if folder == Path(adapters) and json.loads((folder / "config.json").read_text()).get("input") != "features":
            return None  # DIR itself is an adapter of another kind
    except (AdapterError, ValueError):
        return None
    return load_adapter(folder, model, role="draft", layer=model.num_layers)


def make_layer_skip(model: LayeredModel, sparsity: float, num_tokens: int = LAYER_SKIP_TOKENS, threshold: float = 0.0,
                    assist: Drafter | None = None, progress: bool = True, tree_topk: int = 1,
                    total_tokens: int | None = None) -> LayerSkipDrafter:
    """A layer-skip drafter with the model's cached (or newly calibrated) skip set at ``sparsity``."""
    result = load_or_calibrate(model, sparsity, progress=progress)
    return LayerSkipDrafter(model, result.skip, num_tokens=num_tokens, assist=assist, threshold=threshold,
                            sparsity=sparsity, agreement=result.agreement, tree_topk=tree_topk,
                            total_tokens=total_tokens)


def _no_adapters(name: str, d: DraftConfig) -> None:
    if d.adapters is not None or d.threshold:
        raise InvalidArgumentError(f"--adapters and --threshold apply to early-exit and tree drafting, not to {name!r}")


def _ar(model, d: DraftConfig, threshold, progress):
    _no_adapters("ar", d)
    return None


def _pld(model, d: DraftConfig, threshold, progress):
    _no_adapters("pld", d)
    return PromptLookupDrafter(num_tokens=d.num_draft_tokens or 10, max_ngram=d.max_ngram)


def _recycle(model, d: DraftConfig, threshold, progress):
    _no_adapters("recycle", d)
    if d.num_draft_tokens is not None or d.draft_layer is not None or d.tree_topk is not None:
        raise InvalidArgumentError("recycle drafts trees from a table (8 candidates per token): its shape is "
                                   "--total-tokens and --depth; --num-draft-tokens, --draft-layer and --tree-topk "
                                   "do not apply")
    return TokenRecyclingDrafter(model.vocab_size, total_tokens=d.total_tokens or RECYCLE_TOKENS,
                                 depth=d.depth or RECYCLE_DEPTH)


def _layer_skip(model, d: DraftConfig, threshold, progress):
    if d.adapters is not None:
        raise InvalidArgumentError("--adapters does not apply to layer-skip (it needs no training); use dytc to "
                                   "combine layer skipping with the draft adapter")
    if model.weights is not None:  # layers stream: the draft skips exactly those (the model's stream order)
        streamed = streamed_skip(model)
        if streamed is None:
            raise InvalidArgumentError(
                "layer-skip under a memory budget skips the streamed layers, and which layers those should be is "
                "the model's calibrated stream order: none is known for this model, so its deepest layers stream "
                "and every draft token would read them again; run 'cats calibrate MODEL --stream-order' once "
                "(without a budget), or give a budget that keeps every layer resident")
        if d.sparsity is not None:
            raise InvalidArgumentError("under a memory budget layer-skip skips the streamed layers; drop --sparsity "
                                       "(the budget decides how many stream)")
        skip, agreement = streamed
        return LayerSkipDrafter(model, skip, threshold=threshold, agreement=agreement, **layer_skip_shape(d))
    values = d.sparsities((LAYER_SKIP_SPARSITY,))
    if len(values) != 1:
        raise InvalidArgumentError(f"layer-skip takes one sparsity, got {', '.join(map(str, values))}")
    return make_layer_skip(model, values[0], threshold=threshold, progress=progress, **layer_skip_shape(d))


def _dytc(model, d: DraftConfig, threshold, progress):
    if threshold:
        raise InvalidArgumentError("--threshold does not apply to dytc: the scheduler chooses draft lengths itself")
    bucket = speculation_for(model)[0]  # the default shape, or under a budget the bucket chosen for its I/O cost
    feature = _feature_adapter(d.adapters, model)  # an eagle3/ or feature/ head in DIR is used instead of draft/
    sparsities, streamed = d.sparsities(DYTC_SPARSITIES), None
    if model.weights is not None:  # layers stream: its layer-skip drafter skips exactly those, where calibrated
        if d.sparsity is not None:
            raise InvalidArgumentError("under a memory budget dytc's layer skipping skips the streamed layers (where "
                                       "the model has a calibrated stream order) and no other sublayers; drop "
                                       "--sparsity, or give a budget that keeps every layer resident")
        sparsities, streamed = (), streamed_skip(model)
    return make_dytc(model, sparsities, feature_adapter=feature,
                     adapter=_draft_adapter(d.adapters, model) if feature is None else None,
                     max_ngram=d.max_ngram, num_tokens=d.num_draft_tokens,
                     tree_topk=bucket.tree_topk if d.tree_topk is None else d.tree_topk,
                     total_tokens=bucket.total_tokens if d.total_tokens is None else d.total_tokens,
                     depth=bucket.depth if d.depth is None else d.depth, streamed_skip=streamed,
                     max_pass_tokens=model.memory_plan.needs.max_tree_tokens if model.memory_plan else None,
                     progress=progress)


def _dytc_free(model, d: DraftConfig, threshold, progress):
    if d.adapters is not None:
        raise InvalidArgumentError("--adapters does not apply to 'dytc-free' (it schedules the training-free drafters "
                                   "only); use dytc to add the adapters")
    return _dytc(model, d, threshold, progress)


def _eagle(model, d: DraftConfig, threshold, progress):
    """The feature draft adapter of ``adapters`` (``DIR/feature/`` or an adapter folder itself), EAGLE-style."""
    if d.adapters is None:
        raise InvalidArgumentError("method 'eagle' needs --adapters DIR holding a trained feature/ adapter "
                                   "(cats train adapter --input features)")
    if d.num_draft_tokens is not None or d.draft_layer is not None:
        raise InvalidArgumentError("eagle drafts from the target's final features: --draft-layer does not apply, and "
                                   "its draft length is --depth (a chain: --tree-topk 1)")
    adapter = load_adapter(find_adapter(d.adapters, "feature"), model, role="draft", layer=model.num_layers)
    shape = {key: value for key, value in (("tree_topk", d.tree_topk), ("total_tokens", d.total_tokens),
                                           ("depth", d.depth)) if value is not None}  # the rest: the drafter's
    return FeatureDrafter(model, adapter, threshold=threshold, **shape)


def _eagle3(model, d: DraftConfig, threshold, progress):
    """The EAGLE-3 head of ``adapters`` (``DIR/eagle3/`` or a head folder itself)."""
    folder = find_eagle3_folder(d.adapters)
    if folder is None:
        raise InvalidArgumentError("method 'eagle3' needs --adapters DIR holding a trained EAGLE-3 head in DIR/eagle3/ "
                                   "(cats train adapter --arch eagle3)")
    if d.num_draft_tokens is not None or d.draft_layer is not None:
        raise InvalidArgumentError("eagle3 drafts from the fused states of its three target layers: --draft-layer "
                                   "does not apply, and its draft length is --depth (a chain: --tree-topk 1)")
    shape = {key: value for key, value in (("tree_topk", d.tree_topk), ("total_tokens", d.total_tokens),
                                           ("depth", d.depth)) if value is not None}
    return FeatureDrafter(model, load_eagle3_head(folder, model), threshold=threshold, **shape)


def _early_exit_layer(model, d: DraftConfig, adapter) -> None:
    """Under a memory budget the draft layers must be resident (an out-of-range layer is the drafter's error)."""
    layer = adapter.config.layer if adapter is not None else d.draft_layer
    layer = default_draft_layer(model) if layer is None else layer
    if 1 <= layer < model.num_layers:
        check_resident(model, layer, f"drafting from layer {layer}")


def _early_exit(model, d: DraftConfig, threshold, progress):
    adapter = _draft_adapter(d.adapters, model, early_exit=True)
    _early_exit_layer(model, d, adapter)
    num_tokens, chosen = d.num_draft_tokens, None
    if num_tokens is None:
        chosen = speculation_for(model, chain=True)
        num_tokens = chosen[0].num_draft_tokens
    drafter = EarlyExitDrafter(model, layer=d.draft_layer, num_tokens=num_tokens, adapter=adapter, threshold=threshold)
    return _with_speculation(model, drafter, chosen)


def _tree(model, d: DraftConfig, threshold, progress):
    adapter = _draft_adapter(d.adapters, model)
    _early_exit_layer(model, d, adapter)
    tree_topk, total_tokens, depth, chosen = d.tree_topk, d.total_tokens, d.depth, None
    if None in (tree_topk, total_tokens, depth):
        chosen = speculation_for(model)
        tree_topk = chosen[0].tree_topk if tree_topk is None else tree_topk
        total_tokens = chosen[0].total_tokens if total_tokens is None else total_tokens
        depth = chosen[0].depth if depth is None else depth
    drafter = TreeDrafter(model, layer=d.draft_layer, adapter=adapter, tree_topk=tree_topk,
                          total_tokens=total_tokens, depth=depth, threshold=threshold)
    return _with_speculation(model, drafter, chosen)


def _with_speculation(model, drafter, chosen):
    if chosen is not None and model.memory_plan is not None:
        drafter.speculation = chosen[1]
    return drafter


def _adapter_tree(name: str):
    """The drafter factory of ``cats`` and ``cats-no-shallow``: the draft adapter's trees, which need adapters."""
    def make(model, d: DraftConfig, threshold, progress):
        if d.adapters is None:
            raise InvalidArgumentError(f"method {name!r} needs --adapters DIR holding trained draft/ and shallow/ "
                                       "adapters (cats train adapter); without adapters use tree or early-exit")
        return _tree(model, d, threshold, progress)
    return make


# ----------------------------------------------------------------------------------------------- the registry
_TREE = frozenset({"draft_layer", "adapters", "threshold", "tree_topk", "total_tokens", "depth"})
METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ar", "plain decoding", _ar, no_needs),
    Method("pld", "prompt lookup", _pld, pld_needs, frozenset({"num_draft_tokens", "max_ngram"})),
    Method("early-exit", "chain from the early exit", _early_exit, early_exit_needs,
           frozenset({"num_draft_tokens", "draft_layer", "adapters", "threshold"}), CONFIDENCE_STOP),
    Method("tree", "dynamic draft tree from the early exit", _tree, tree_needs, _TREE, CONFIDENCE_STOP),
    Method("cats", "draft adapter + tree + shallow-verifier cascade; needs --adapters", _adapter_tree("cats"),
           cats_needs, _TREE | {"sv_threshold", "sv_passes"}, CONFIDENCE_STOP, cascade=True),
    Method("cats-no-shallow", "cats without the shallow-verifier cascade", _adapter_tree("cats-no-shallow"),
           tree_needs, _TREE, CONFIDENCE_STOP),
    Method("layer-skip", "calibrated sublayers skipped (under a budget: the streamed layers)", _layer_skip,
           layer_skip_needs, frozenset({"num_draft_tokens", "threshold", "sparsity", "tree_topk", "total_tokens",
                                        "depth"})),
    Method("dytc", "scheduler over prompt lookup, token recycling, layer skipping and, with --adapters, the draft "
           "adapter", _dytc, dytc_needs, frozenset({"num_draft_tokens", "max_ngram", "adapters", "tree_topk",
                                                      "total_tokens", "depth", "sparsity"})),
    Method("dytc-free", "dytc over the training-free drafters only (prompt lookup, token recycling, layer "
           "skipping): the baseline of the adapter methods", _dytc_free, dytc_needs,
           frozenset({"num_draft_tokens", "max_ngram", "tree_topk", "total_tokens", "depth", "sparsity"})),
    Method("eagle", "trees from the feature draft adapter in --adapters, which reads the target's final features; "
           "chain: --tree-topk 1", _eagle, eagle_needs,
           frozenset({"adapters", "threshold", "tree_topk", "total_tokens", "depth"}), CONFIDENCE_STOP),
    Method("eagle3", "trees from the EAGLE-3 head in --adapters (DIR/eagle3/), which reads three target layers' "
           "states; chain: --tree-topk 1", _eagle3, eagle3_needs,
           frozenset({"adapters", "threshold", "tree_topk", "total_tokens", "depth"}), CONFIDENCE_STOP),
    Method("recycle", "token recycling: training-free trees from the target's own recent candidates", _recycle,
           recycle_needs, frozenset({"total_tokens", "depth"})),
)}


def method(name: str) -> Method:
    """The registry entry of ``name``; an `UnknownMethodError` listing the known methods otherwise."""
    if name not in METHODS:
        raise UnknownMethodError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}")
    return METHODS[name]


def check_method(name: str) -> str:
    """Return ``name`` if CATS knows it, else raise `UnknownMethodError` listing the known ones."""
    return method(name).name


def help_text() -> str:
    """The methods as the CLI lists them."""
    return ", ".join(f"{m.name} ({m.summary})" for m in METHODS.values())


def make_drafter(name: str, model: LayeredModel, drafting: DraftConfig | None = None,
                 progress: bool = True) -> Drafter | None:
    """The drafter of method ``name``; ``None`` for plain autoregressive decoding (``ar``).

    ``drafting.adapters``: a folder with trained adapters (``DIR/draft/`` or an adapter folder itself); early exit
    and trees then draft through the draft adapter at its own layer (early exit through ``DIR/early-exit/``, an
    adapter that also reads the target's final features, when there is one). ``threshold``: their confidence stop;
    None: the method's default (`CONFIDENCE_STOP` for the adapter drafters, also under a memory budget, 0 for
    layer-skip). ``sparsity``: layer-skip's fraction of skipped sublayers (default 0.4), or dytc's list of them
    (default 0.4, 0.6); skip sets come from the calibration cache, calibrated on first use (``progress``: with a
    progress bar on stderr).

    Left as None, the early-exit draft length and the tree shape are 4 and (4, 16, 5); when the model streams
    layers under a memory budget they come from the speculation bucket chosen for the budget's I/O cost
    (`cats.draft.sizing`). Under a budget, layer-skip and dytc's layer skipping skip the streamed layers, where the
    model has a calibrated stream order (`cats.draft.layer_skip.stream_order`)."""
    entry, d = method(name), drafting or DraftConfig()
    d.validate()  # before any calibration or adapter load
    threshold = entry.threshold if d.threshold is None else d.threshold
    if d.sparsity is not None and "sparsity" not in entry.settings:
        raise InvalidArgumentError(f"--sparsity applies to layer-skip and dytc, not to {name!r}")
    return entry.make(model, d, threshold, progress)


def make_scorer(name: str, model: LayeredModel, drafter, drafting: DraftConfig | None = None):
    """What verifies method ``name``'s drafts: the shallow verifier's cascade for ``cats`` (its shallow adapter from
    ``drafting.adapters``), else the plain target."""
    entry, d = method(name), drafting or DraftConfig()
    if not entry.cascade:
        if d.sv_passes != 1:
            raise InvalidArgumentError(f"--sv-passes is a setting of the cascade (method cats), not of {name!r}")
        return TargetScorer()
    return make_cascade(model, drafter, d.adapters, d.sv_threshold, d.sv_passes)


def memory_needs(config, dtype: torch.dtype, name: str = "ar", drafting: DraftConfig | None = None,
                 context_tokens: int | None = None, prefetch: int | None = None,
                 prompt_tokens: int | None = None, on_blocks: bool = False) -> MemoryNeeds:
    """What method ``name`` needs resident besides the weights: the layers every draft step runs (``[0, L_d)``; all
    of them for layer-skip and dytc), its adapters, and the largest pass it verifies (the largest speculation bucket
    when the tree size is left to the budget). The cascade's shallow layers ``[L_d, L_sv)`` run once per pass: they
    stay resident when the budget allows (as many layers as fit always do) and stream otherwise. ``prefetch``: layers
    read ahead; None: left to the plan, from `DEFAULT_PREFETCH` down to 1, whichever keeps the most layers resident.
    ``on_blocks``: the model computes on GGUF blocks, where adapters hold their matrices as their files store them."""
    entry, d = method(name), drafting or DraftConfig()
    d.validate()
    held = HeldAs(torch.empty(0, dtype=dtype).element_size(), stored_matrices=on_blocks)
    context = int(getattr(config, "max_position_embeddings", 0) or DEFAULT_CONTEXT_TOKENS)
    needs = MemoryNeeds(context_tokens=context_tokens or min(DEFAULT_CONTEXT_TOKENS, context),
                        prefetch=DEFAULT_PREFETCH if prefetch is None else prefetch, prefetch_fixed=prefetch is not None,
                        prompt_tokens=prompt_tokens, prompt_captures=False)  # an adapter's needs set it
    entry.needs(needs, config, held, d)
    if prompt_tokens is None:  # a prompt of any length up to the context: it runs in chunks where nothing captures
        needs.prompt_chunk = PROMPT_CHUNK
    return needs
