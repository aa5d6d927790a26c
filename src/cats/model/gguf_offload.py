"""A GGUF model on its own blocks under a memory budget: the deep layers stream from the GGUF file itself.

The model is loaded as in memory (`cats.model.gguf_model`: every weight a view of the memory-mapped file, nothing
read yet), then planned with the budget's planner (`cats.model.weights.plan_for`) on the blocks' own bytes: the
file's tensor bytes, not a float copy's. Resident parts stay views of the mapping (read on first use, charged as the
kernel charges a mapped file). Each streamed layer is one span of the file (llama.cpp writes a layer's tensors back
to back): `LayerStreamer` reads that span, aligned to 4096 bytes, into one of its buffers (``O_DIRECT`` by default,
so the page cache holds none of it) and the layer's parameters become views of the buffer for as long as the layer
runs; between uses they are on the meta device. The kernels then compute on the blocks as read: no decode, no copy.
Tensors of a layer that are not stored as used (Gemma's norms, which transformers shifts) are small float32 copies
and stay resident.
"""
from __future__ import annotations

from pathlib import Path

import torch

from cats.errors import InvalidArgumentError
from cats.model.gguf_model import FileMapping, load_gguf_model
from cats.model.identity import hf_model_fingerprint
from cats.model.kernels.gguf_modules import GGUFLinear
from cats.model.layered import eos_token_ids
from cats.model.streamed_head import StreamedHead, draft_rows, draft_vocabulary, draft_vocabulary_size, head_pieces
from cats.model.weights.budget import STORE_ALIGNMENT, MemoryNeeds, MemoryPlan
from cats.model.weights.offload import check_io, default_needs, plan_for, set_parameters
from cats.model.weights.parts import PartHeader, TensorEntry
from cats.model.weights.rss import bound_heap
from cats.model.weights.stream import LayerStreamer
from cats.model.weights.stream_order import apply_stream_order


def layer_span(layer: torch.nn.Module, mapping: FileMapping) -> PartHeader:
    """Where ``layer``'s parameters lie in the mapped file: one aligned span, each parameter that views the file as
    an entry (offsets from the span's start). Parameters that are copies are left out (they stay resident)."""
    placed = {}
    for name, parameter in layer.named_parameters():
        offset = mapping.offset_of(parameter)
        if offset is not None:
            placed[name] = (offset, parameter)
    if not placed:
        raise ValueError("a layer with no tensor in the file cannot stream")
    start = min(offset for offset, _ in placed.values()) // STORE_ALIGNMENT * STORE_ALIGNMENT
    entries = {}
    for name, (offset, parameter) in placed.items():
        size = parameter.numel() * parameter.element_size()
        entries[name] = TensorEntry(parameter.dtype, tuple(parameter.shape), offset - start, offset - start + size)
    end = max(entry.end for entry in entries.values())
    return PartHeader(mapping.path, start, end, entries)


def load_gguf_under_budget(gguf_path: Path, metadata: Path, budget: str | int, needs: MemoryNeeds | None = None,
                           io: str = "direct", attn_implementation: str = "sdpa", layer_store=None):
    """The GGUF file's model on its blocks under ``budget``: ``(hf_model, plan, streamer or None)``. Raises
    `BudgetTooSmallError` (naming the minimum) before any weight is read when the budget cannot hold the minimum."""
    hf_model = load_gguf_model(gguf_path, metadata, attn_implementation)
    return (hf_model, *stream_gguf_layers(hf_model, budget, needs, io, layer_store))


def stream_gguf_layers(hf_model, budget: str | int, needs: MemoryNeeds | None = None, io: str = "direct",
                       layer_store=None):
    """Plan ``hf_model`` (a GGUF model on its blocks, `cats.model.gguf_model`) under ``budget`` and stream the layers
    the plan does not keep: ``(plan, streamer or None)``. The streamed layers' parameters go to the meta device, and
    their pages of the file, if a forward has read them, are handed back to the kernel. ``layer_store`` is refused:
    there is none (it is the float path's)."""
    if layer_store is not None:
        raise InvalidArgumentError("a GGUF model on its blocks streams its layers from the file itself and keeps no "
                                   "layer store; drop the layer store, or load it with --kernels aten to stream "
                                   "dequantised layers from one")
    check_io(io)
    bound_heap()
    mapping: FileMapping = hf_model.gguf_mapping
    layers = hf_model.model.layers[: hf_model.config.num_hidden_layers]
    spans = [layer_span(layer, mapping) for layer in layers]
    sizes = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers]
    needs = default_needs(hf_model.config, needs)
    if needs.skip_streamed:  # what the method's skip draft skips streams, where calibrated
        apply_stream_order(needs, hf_model_fingerprint(hf_model), len(layers))
    plan: MemoryPlan = plan_for(hf_model, budget, needs,
                                stored_layers=[max(span.data_bytes, size) for span, size in zip(spans, sizes)])
    if plan.parts.embed_rows:  # planned for the rows read: fault in those rows only
        mapping.read_at_random(hf_model.model.embed_tokens.blocks)
    if not plan.streamed and not plan.head_streamed:
        return plan, None
    layouts = {i: spans[i] for i in plan.streamed}
    for i in plan.streamed:  # nothing of a streamed layer is touched outside its turn
        parameters = dict(layers[i].named_parameters())
        set_parameters(layers[i], {name: torch.empty_like(parameters[name], device="meta")
                                   for name in layouts[i].entries})
        mapping.release(layouts[i].data_start, layouts[i].data_bytes)
    units = list(layers)
    if plan.head_streamed:
        units += _stream_head(hf_model, plan, mapping, layouts)
    streamer = LayerStreamer(units, len(units), layouts, plan.pool_slots, plan.slot_bytes, io=io,
                             read_buffers=plan.read_buffers)
    if plan.head_streamed:
        hf_model.lm_head.streamer = streamer
    return plan, streamer


def _stream_head(hf_model, plan: MemoryPlan, mapping: FileMapping, layouts: dict) -> list:
    """Replace the lm_head by a `StreamedHead`: a copy of its draft-vocabulary rows stays (``hf_model.draft_rows``;
    its leading rows serve the head too), the rows after them are pieces read as units ``L, L + 1, ..`` of the
    streamer (their spans of the file added to ``layouts``), and the head's pages of the file are handed back.
    Returns the pieces."""
    hf_model.cats_fingerprint = hf_model_fingerprint(hf_model)  # it reads the head's rows, which will stream
    head = hf_model.lm_head
    offset, (rows, row_bytes) = mapping.offset_of(head.blocks), head.blocks.shape
    vocab = draft_vocabulary(rows, eos_token_ids(getattr(hf_model, "generation_config", None), hf_model.config, None))
    kept = draft_vocabulary_size(rows)  # rows [0, kept): the draft's first rows, the head's resident part
    hf_model.draft_rows = draft_rows(head, vocab)
    pieces = head_pieces(head, kept, plan.head_chunk_rows)
    first, start_row = plan.num_layers, kept
    for j, piece in enumerate(pieces):
        begin = offset + start_row * row_bytes
        start = begin // STORE_ALIGNMENT * STORE_ALIGNMENT
        size = piece.out_features * row_bytes
        layouts[first + j] = PartHeader(mapping.path, start, begin - start + size, {
            "blocks": TensorEntry(head.blocks.dtype, (piece.out_features, row_bytes), begin - start,
                                  begin - start + size)})
        start_row += piece.out_features
    mapping.release(offset, rows * row_bytes)
    resident = GGUFLinear(hf_model.draft_rows.rows.blocks[:kept], head.type_code, head.columns)
    hf_model.lm_head = StreamedHead(resident, pieces, first)
    return pieces
