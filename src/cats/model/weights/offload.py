"""Running a model under a memory budget: plan, layer store, resident parts, streamer.

Two ways in:

* `load_under_budget` (what ``cats.load(..., memory_budget=...)`` calls): builds the model skeleton with every
  parameter on the meta device, plans, makes the layer store from the checkpoint if it is not there yet (one part
  in memory at a time), reads only the resident parts, and starts streaming the rest. The streamed layers are
  never materialised whole, so the process's peak stays within the plan.
* `offload_model`: a model already in memory is put under a budget in place (the store is written from its
  parameters, then the streamed layers' parameters are dropped). Its peak so far already held the whole model;
  use it for tests and for models that do not come from a checkpoint folder.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from cats.errors import InvalidArgumentError
from cats.model.identity import fingerprint_of, fingerprint_rows, model_fingerprint
from cats.model.kernels.gguf_modules import GGUFRows
from cats.model.kernels.layer_forward import whole_layer_forward
from cats.model.weights.blocks import GGUFBlocks
from cats.model.weights.budget import (
    DEFAULT_CONTEXT_TOKENS,
    BudgetTooSmallError,
    MemoryNeeds,
    MemoryPlan,
    PartSizes,
    parse_budget,
    plan_memory,
)
from cats.model.weights.parts import Checkpoint
from cats.model.weights.rss import bound_heap
from cats.model.weights.store import (
    LayerStore,
    ensure_store,
    model_source,
    part_modules,
    tied_aliases,
    write_from_checkpoint,
    write_from_model,
)
from cats.model.weights.stream import IO_MODES, LayerStreamer, store_layouts
from cats.model.weights.stream_order import apply_stream_order
from cats.model.weights.transient import activation_bytes, kv_cache_bytes, prompt_forward_tokens


def plan_for(hf_model, budget: str | int, needs: MemoryNeeds, stored_layers: list[int] | None = None) -> MemoryPlan:
    """The plan for ``hf_model`` (real or meta parameters) under ``budget`` (bytes, ``300MiB`` or ``50%``).
    ``stored_layers``: each decoder layer's bytes in the layer store, where it holds quantised blocks.

    When the draft size is left to the budget (``needs.pass_sizes``), the largest speculation bucket whose
    activations fit without taking a resident layer from the smallest bucket's plan is reserved
    (``needs.max_tree_tokens`` is set to it): a resident layer saves its read on every pass, where a larger tree
    only adds the tokens it gets accepted (Qwen2.5-Coder-1.5B at 914 MiB: reserving `cats`'s largest tree kept 2
    layers resident against 13 for `ar`, and the tree it then chose was smaller; docs/memory.md). When the read-ahead
    is left to the budget too (``needs.prefetch_fixed`` False), each depth from ``needs.prefetch`` down to one is
    planned and the one that keeps the most layers resident wins, the deeper on a tie (``needs.prefetch`` is set to
    it): a stream buffer costs what a resident layer does, and a resident layer saves its read on every pass, where a
    second layer read ahead only hides uneven reads (Qwen2.5-Coder-1.5B at 914 MiB: one read ahead and one more layer
    resident ran `ar` 7 % faster and `dytc` as fast; docs/memory.md). So a budget that cannot hold a third stream
    buffer runs with two instead of refusing. The error for a budget too small names the minimum with the least of
    both.

    The cascade (``needs.speculation`` ``cascade``) adds a correction branch per node only while its shallow layers
    ``[0, needs.shallow_layers)`` are all resident (`cats.verify.cascade.make_cascade`); a plan that streams one of
    them verifies the bare tree. Each bucket is planned for the corrected pass all the same, and for the bare one
    (``needs.bare_passes``) only where that does not fit: the room the larger reservation leaves absorbs the
    cascade's heap that the plan does not price (Qwen2.5-Coder-1.5B at 914 MiB: 967-1,300 major faults with it,
    1,301-6,218 and at worst half the speed with a layer more resident in its place; docs/memory.md)."""
    sizes = sorted(needs.pass_sizes) or [needs.max_tree_tokens]
    depths = [needs.prefetch] if needs.prefetch_fixed else list(range(needs.prefetch, 0, -1)) or [needs.prefetch]
    error, best = None, None  # best: (prefetch, tokens, plan) with the most resident layers
    for prefetch in depths:
        needs.prefetch = prefetch
        chosen = None  # (tokens, plan) of the largest pass that keeps as many layers resident as the smallest
        for tokens in sizes:  # smallest first
            try:
                tokens, plan = _plan_pass(hf_model, budget, needs, stored_layers, tokens)
            except BudgetTooSmallError as too_small:
                if chosen is None:  # not even the smallest fits: the next read-ahead, or this error
                    error = too_small
                break
            if chosen is not None and plan.resident_layers < chosen[1].resident_layers:
                break
            chosen = (tokens, plan)
        if chosen is not None and (best is None or chosen[1].resident_layers > best[2].resident_layers):
            best = (prefetch, *chosen)
    if best is None:
        raise error
    needs.prefetch, needs.max_tree_tokens = best[0], best[1]  # the plan holds ``needs``: it names what it was made for
    return best[2]


def _plan_pass(hf_model, budget: str | int, needs: MemoryNeeds, stored_layers: list[int] | None,
               tokens: int) -> tuple[int, MemoryPlan]:
    """``(tokens reserved, plan)`` for a pass of ``tokens``. The cascade's (a correction per node) falls back to its
    bare tree's (``needs.bare_passes``) where the corrected pass does not fit and the plan for the bare one streams a
    shallow layer, so that no correction is added."""
    needs.max_tree_tokens = tokens
    try:
        return tokens, _plan(hf_model, budget, needs, stored_layers)
    except BudgetTooSmallError as corrected:
        bare = needs.bare_passes.get(tokens)
        if bare is None:
            raise
        needs.max_tree_tokens = bare
        plan = _plan(hf_model, budget, needs, stored_layers)  # (too small for this too: its smaller minimum is named)
        if plan.resident_prefix >= needs.shallow_layers:  # the shallow layers resident: corrections, which do not fit
            raise corrected
        return bare, plan


def _plan(hf_model, budget: str | int, needs: MemoryNeeds, stored_layers: list[int] | None = None) -> MemoryPlan:
    config = hf_model.config
    parts = PartSizes.of(hf_model)
    parts.stored_layers = stored_layers
    embed = hf_model.model.embed_tokens
    if isinstance(embed, GGUFRows):  # a view of the mapped file: only the rows the context reads are ever in memory
        parts.embed_rows_read(embed.blocks[0].numel() * embed.blocks.element_size(),
                              needs.context_tokens + needs.max_tree_tokens)
    compute_dtype = getattr(embed, "compute_dtype", None)  # GGUF rows: float32 activations; else the weights' dtype
    itemsize = compute_dtype.itemsize if compute_dtype is not None else embed.weight.element_size()
    kv = kv_cache_bytes(config, itemsize, needs.context_tokens + needs.max_tree_tokens, needs.extra_cache_layers)
    # a decode pass over the largest tree (logits for every node), or the prefill (logits for one row): on the
    # whole-layer kernel where a model on GGUF blocks runs every forward on it (a pass, tens of tokens, is priced
    # as through the modules all the same: its logits dominate, and its heap is measured close to that estimate)
    prompt, call = prompt_forward_tokens(needs)  # the prompt's last forward holds the most: the whole context
    fused = isinstance(embed, GGUFRows) and whole_layer_forward(hf_model.model.layers, compute_dtype)
    activation = max(activation_bytes(config, itemsize, needs.max_tree_tokens, needs.context_tokens),
                     activation_bytes(config, itemsize, call, prompt - call, logit_rows=1, fused=fused,
                                      captures=needs.prompt_captures))
    return plan_memory(parse_budget(budget, parts.weights), parts, needs, kv, activation)


def check_io(io: str) -> None:
    if io not in IO_MODES:
        raise InvalidArgumentError(f"offload I/O mode must be one of {', '.join(IO_MODES)}, got {io!r}")


def default_needs(config, needs: MemoryNeeds | None) -> MemoryNeeds:
    """``needs``, or where None the default: a KV cache for the default context (or the model's, if shorter)."""
    if needs is not None:
        return needs
    context = int(getattr(config, "max_position_embeddings", 0) or DEFAULT_CONTEXT_TOKENS)
    return MemoryNeeds(context_tokens=min(DEFAULT_CONTEXT_TOKENS, context))


def set_parameters(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Replace ``module``'s parameters named in ``tensors`` (dotted names below it) by those tensors, frozen."""
    for name, tensor in tensors.items():
        owner, _, attribute = name.rpartition(".")
        target = module.get_submodule(owner) if owner else module
        target._parameters[attribute] = torch.nn.Parameter(tensor, requires_grad=False)


def _start_streaming(hf_model, store: LayerStore, plan: MemoryPlan, io: str) -> LayerStreamer | None:
    if not plan.streamed:
        return None
    layouts = store_layouts(store, plan.streamed)
    return LayerStreamer(hf_model.model.layers, plan.num_layers, layouts, plan.pool_slots, plan.slot_bytes, io=io,
                         read_buffers=plan.read_buffers, store=store)


def build_skeleton(config, dtype: torch.dtype, attn_implementation: str = "sdpa"):
    """The ``*ForCausalLM`` module with every parameter on the meta device (buffers such as rotary frequencies
    are real), tied weights tied."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    hf_model.tie_weights()
    return hf_model.eval().requires_grad_(False)


def load_under_budget(folder: str | Path, config, dtype: torch.dtype, budget: str | int,
                      needs: MemoryNeeds | None = None, io: str = "direct", layer_store: str | Path | None = None,
                      attn_implementation: str = "sdpa"):
    """Load the checkpoint in ``folder`` under ``budget``: ``(hf_model, plan, streamer or None)``.

    Raises `BudgetTooSmallError` before reading any weight when the budget cannot hold the minimum."""
    check_io(io)
    bound_heap()
    hf_model = build_skeleton(config, dtype, attn_implementation)
    _load_generation_config(hf_model, folder)
    needs = default_needs(config, needs)
    if needs.skip_streamed:  # what the method's skip draft skips streams, where calibrated
        apply_stream_order(needs, checkpoint_fingerprint(folder, hf_model, dtype), config.num_hidden_layers)
    blocks = GGUFBlocks.of_checkpoint(folder, dtype)
    plan = plan_for(hf_model, budget, needs, stored_layers=_stored_estimate(hf_model, blocks))
    store = checkpoint_store(folder, hf_model, dtype, layer_store, blocks)
    stored = store.stored_layer_bytes()
    if stored != (plan.parts.stored_layers or plan.parts.layers):  # a tensor whose blocks did not decode to the
        plan = plan_for(hf_model, budget, needs, stored_layers=stored)  # checkpoint's bits is plain: plan again
    modules = part_modules(hf_model)
    resident = ["embed", "norm", *(["lm_head"] if "lm_head" in modules else []),
                *(f"layer-{i:03d}" for i in plan.resident)]
    for part in resident:
        set_parameters(modules[part][1], store.read(part))
    if "lm_head" not in modules:
        hf_model.lm_head._parameters["weight"] = hf_model.model.embed_tokens.weight
    return hf_model, plan, _start_streaming(hf_model, store, plan, io)


def checkpoint_store(folder: str | Path, hf_model, dtype: torch.dtype, layer_store: str | Path | None = None,
                     blocks: GGUFBlocks | None = None) -> LayerStore:
    """The layer store of the checkpoint in ``folder`` (made now if absent), for the model skeleton ``hf_model``.
    Its key is the model fingerprint, computed from the checkpoint's own lm_head rows, so that a store holding
    another model's weights is caught (`cats.model.weights.store.open_store`). ``blocks``: the GGUF file the checkpoint
    came from, whose quantised blocks the store keeps where they decode to the checkpoint's weights (its own key:
    a store with blocks and one without never share a folder)."""
    config = hf_model.config
    checkpoint = Checkpoint(Path(folder))
    parts = {part: sum(p.numel() * p.element_size() for p in module.parameters())
             for part, (_, module) in part_modules(hf_model).items()}
    source = checkpoint.source()
    if blocks is not None:
        source["blocks"] = blocks.record()
        source["digest"] = hashlib.sha256(json.dumps([source["digest"], source["blocks"]]).encode()).hexdigest()
    return ensure_store(layer_store, checkpoint_fingerprint(folder, hf_model, dtype), dtype, config, source, parts,
                        write_from_checkpoint(checkpoint, hf_model, dtype, blocks))


def checkpoint_fingerprint(folder: str | Path, hf_model, dtype: torch.dtype) -> str:
    """The model fingerprint of the checkpoint in ``folder``, from its own lm_head rows (``hf_model``: its skeleton)."""
    rows = Checkpoint(Path(folder)).read("lm_head.weight", tied_aliases(hf_model),
                                         fingerprint_rows(hf_model.config.vocab_size))
    return fingerprint_of(hf_model.config, rows.to(dtype))


def _stored_estimate(hf_model, blocks: GGUFBlocks | None) -> list[int] | None:
    """What each decoder layer will occupy in a store made with ``blocks`` (None: no blocks, the plain size)."""
    if blocks is None:
        return None
    layers = hf_model.model.layers[: hf_model.config.num_hidden_layers]
    return [blocks.layer_bytes(i, {name: tuple(p.shape) for name, p in layer.named_parameters()},
                               next(layer.parameters()).element_size()) for i, layer in enumerate(layers)]


def _load_generation_config(hf_model, folder) -> None:
    """``from_pretrained`` reads ``generation_config.json`` (end-of-sequence ids); the skeleton must too."""
    if (Path(folder) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        try:
            hf_model.generation_config = GenerationConfig.from_pretrained(folder)
        except (OSError, ValueError):
            pass


def offload_model(model, budget: str | int, needs: MemoryNeeds | None = None, io: str = "direct",
                  layer_store: str | Path | None = None) -> MemoryPlan:
    """Put a `LayeredModel` already in memory under ``budget``: store its layers (once), drop the streamed layers'
    parameters and stream them from then on. Returns the plan (also ``model.memory_plan``)."""
    check_io(io)
    bound_heap()
    if model.weights is not None:
        raise InvalidArgumentError("this model already runs under a memory budget; load it again to change the budget")
    hf_model = model.hf_model
    needs = default_needs(model.config, needs)
    if needs.skip_streamed:  # what the method's skip draft skips streams, where calibrated
        apply_stream_order(needs, model_fingerprint(model), model.num_layers)
    plan = plan_for(hf_model, budget, needs)
    modules = part_modules(hf_model)
    parts = {part: sum(p.numel() * p.element_size() for p in module.parameters()) for part, (_, module) in modules.items()}
    store = ensure_store(layer_store, model_fingerprint(model), model.dtype, model.config, model_source(hf_model),
                         parts, write_from_model(hf_model))
    for layer in plan.streamed:
        module = model.layers[layer]
        set_parameters(module, {name: torch.empty_like(p, device="meta") for name, p in module.named_parameters()})
    model.attach_weights(_start_streaming(hf_model, store, plan, io), plan)
    return plan


def check_resident(model, layers: int, what: str) -> None:
    """Refuse to run ``what`` (which runs layers ``[0, layers)`` every draft step) when the plan streams some of
    them: every draft step would then read them again."""
    plan = model.memory_plan
    if plan is not None and layers > plan.resident_prefix:
        raise InvalidArgumentError(
            f"{what} runs layers [0, {layers}) every draft step, but the memory plan keeps only [0, "
            f"{plan.resident_prefix}) resident; load the model with the method's needs (cats.methods.memory_needs) "
            "or a larger budget")

