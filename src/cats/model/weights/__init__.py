"""Weights under a memory budget: the planner (`budget`), the per-layer store (`store`) with the GGUF file's own
quantised blocks (`blocks`), the streamer with access-order prefetch (`stream`), loading and offloading under a
budget (`offload`) and process memory measurement (`rss`). See docs/memory.md."""

from cats.model.weights.budget import (
                                       BudgetTooSmallError,
                                       MemoryNeeds,
                                       MemoryPlan,
                                       PartSizes,
                                       layer_ranges,
                                       parse_budget,
                                       plan_memory,
)
from cats.model.weights.offload import load_under_budget, offload_model, plan_for
from cats.model.weights.parts import StoreError
from cats.model.weights.store import LayerStore
from cats.model.weights.stream import LayerStreamer, StreamCounters

__all__ = [
    "BudgetTooSmallError", "LayerStore", "LayerStreamer", "MemoryNeeds", "MemoryPlan", "PartSizes", "StoreError",
    "StreamCounters", "layer_ranges", "load_under_budget", "offload_model", "parse_budget", "plan_for", "plan_memory",
]
