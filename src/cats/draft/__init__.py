"""Virtual draft models made from the target itself, one module each, and the method registry."""

from __future__ import annotations

from cats.draft.base import DecodeState, Draw, Drafter, Proposal
from cats.draft.early_exit import EarlyExitDrafter, default_draft_layer
from cats.draft.prompt_lookup import PromptLookupDrafter
from cats.draft.tree_draft import TreeDrafter
from cats.errors import InvalidArgumentError, UnknownMethodError
from cats.model import LayeredModel

METHODS = ("ar", "pld", "early-exit", "tree", "cats", "cats-no-shallow")
# cats = draft adapter + dynamic tree + shallow-verifier cascade; cats-no-shallow ablates the cascade


def _draft_adapter(adapters: str | None, model: LayeredModel):
    if adapters is None:
        return None
    from cats.draft.adapter import find_adapter, load_adapter

    return load_adapter(find_adapter(adapters, "draft"), model, role="draft")


def check_method(method: str) -> str:
    """Return ``method`` if CATS knows it, else raise `UnknownMethodError` listing the known ones."""
    if method not in METHODS:
        raise UnknownMethodError(f"unknown method {method!r}; known methods: {', '.join(METHODS)}")
    return method


def make_drafter(
    method: str,
    model: LayeredModel,
    num_draft_tokens: int | None = None,
    draft_layer: int | None = None,
    max_ngram: int = 3,
    adapters: str | None = None,
    threshold: float = 0.0,
    tree_topk: int = 4,
    total_tokens: int = 16,
    depth: int = 5,
) -> Drafter | None:
    """The drafter for a method name; ``None`` for plain autoregressive decoding (``ar``).

    ``adapters``: a folder with trained adapters (``DIR/draft/`` or an adapter folder itself); early exit and
    trees then draft through the draft adapter at its own layer. ``threshold``: their confidence stop.
    ``tree_topk``, ``total_tokens``, ``depth``: the shape of dynamic draft trees (method ``tree``)."""
    check_method(method)
    if method in ("cats", "cats-no-shallow") and adapters is None:
        raise InvalidArgumentError(f"method {method!r} needs --adapters DIR holding trained draft/ and shallow/ adapters "
                                   "(cats train adapter); without adapters use tree or early-exit")
    if method in ("ar", "pld") and (adapters is not None or threshold):
        raise InvalidArgumentError(f"--adapters and --threshold apply to early-exit and tree drafting, not to {method!r}")
    if method == "ar":
        return None
    if method == "pld":
        return PromptLookupDrafter(num_tokens=num_draft_tokens or 10, max_ngram=max_ngram)
    if method == "early-exit":
        return EarlyExitDrafter(model, layer=draft_layer, num_tokens=num_draft_tokens or 4,
                                adapter=_draft_adapter(adapters, model), threshold=threshold)
    if method in ("tree", "cats", "cats-no-shallow"):
        return TreeDrafter(model, layer=draft_layer, adapter=_draft_adapter(adapters, model), tree_topk=tree_topk,
                           total_tokens=total_tokens, depth=depth, threshold=threshold)
    raise AssertionError(f"method {method!r} is listed in METHODS but has no drafter")


__all__ = [
    "DecodeState", "Draw", "Drafter", "EarlyExitDrafter", "METHODS", "PromptLookupDrafter", "Proposal", "TreeDrafter",
    "check_method", "default_draft_layer", "make_drafter",
]
