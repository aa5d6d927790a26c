"""Memory budget and layer offloading: the planner (`budget`), the per-layer store (`store`), the streamer with
access-order prefetch (`stream`), loading and offloading under a budget (`offload`), the speculation size chosen
from the budget (`speculation`) and process memory measurement (`rss`). See docs/memory.md."""

from cats.memory.budget import (BudgetTooSmallError, MemoryNeeds, MemoryPlan, PartSizes, parse_budget,
                                plan_memory)
from cats.memory.offload import load_under_budget, memory_needs, offload_model, plan_for, prepare
from cats.memory.store import LayerStore, StoreError
from cats.memory.stream import LayerStreamer, StreamCounters

__all__ = [
    "BudgetTooSmallError", "LayerStore", "LayerStreamer", "MemoryNeeds", "MemoryPlan", "PartSizes", "StoreError",
    "StreamCounters", "load_under_budget", "memory_needs", "offload_model", "parse_budget", "plan_for",
    "plan_memory", "prepare",
]
