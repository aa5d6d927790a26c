"""Virtual draft models made from the target itself, one module each, and the method registry."""

from __future__ import annotations

from cats.draft.base import DecodeState, Drafter, Proposal
from cats.draft.early_exit import EarlyExitDrafter, default_draft_layer
from cats.draft.prompt_lookup import PromptLookupDrafter
from cats.errors import InvalidArgumentError, UnknownMethodError
from cats.model import LayeredModel

METHODS = ("ar", "pld", "early-exit")


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
) -> Drafter | None:
    """The drafter for a method name; ``None`` for plain autoregressive decoding (``ar``).

    ``adapters``: a folder with trained adapters (``DIR/draft/`` or an adapter folder itself); early exit then
    drafts through the draft adapter at its own layer. ``threshold``: early exit's confidence stop."""
    check_method(method)
    if method != "early-exit" and (adapters is not None or threshold):
        raise InvalidArgumentError(f"--adapters and --threshold apply to early-exit drafting, not to method {method!r}")
    if method == "ar":
        return None
    if method == "pld":
        return PromptLookupDrafter(num_tokens=num_draft_tokens or 10, max_ngram=max_ngram)
    if method == "early-exit":
        adapter = None
        if adapters is not None:
            from cats.draft.adapter import find_adapter, load_adapter

            adapter = load_adapter(find_adapter(adapters, "draft"), model, role="draft")
        return EarlyExitDrafter(model, layer=draft_layer, num_tokens=num_draft_tokens or 4, adapter=adapter,
                                threshold=threshold)
    raise AssertionError(f"method {method!r} is listed in METHODS but has no drafter")


__all__ = [
    "DecodeState", "Drafter", "EarlyExitDrafter", "METHODS", "PromptLookupDrafter", "Proposal",
    "check_method", "default_draft_layer", "make_drafter",
]
