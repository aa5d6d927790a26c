"""Virtual draft models made from the target itself, one module each: prompt lookup, early exit (chain and tree),
feature drafting (EAGLE-style), token recycling, layer skipping, and DyTC's scheduler over them. Which method uses
which drafter, and with what defaults: `cats.methods`."""

from cats.draft.base import DecodeState, Drafter, Draw, Proposal
from cats.draft.early_exit import EarlyExitDrafter, default_draft_layer
from cats.draft.layer_skip.drafter import LayerSkipDrafter, SkipSet
from cats.draft.prompt_lookup import PromptLookupDrafter
from cats.draft.tree import TreeDrafter

__all__ = [
    "DecodeState", "Draw", "Drafter", "EarlyExitDrafter", "LayerSkipDrafter", "PromptLookupDrafter", "Proposal",
    "SkipSet", "TreeDrafter", "default_draft_layer",
]
