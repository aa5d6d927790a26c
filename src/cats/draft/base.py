"""What every drafter (virtual draft model) hands to the decode loop, and what it may assume.

Notation, used across CATS: p = the target's distribution, q = a draft's distribution; ``x`` is the pending token
(the newest committed token, not yet in the KV cache); ``d_1 .. d_k`` are drafted tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from cats.model import KVCache, LayeredModel
from cats.tree import is_chain


@dataclass
class DecodeState:
    """The decode loop's state as a drafter sees it (read-only, except that a drafter may write the cache as
    described in `Drafter.propose`)."""

    model: LayeredModel
    cache: KVCache
    token_ids: list[int]  # prompt + generated tokens; the last one, x, is pending (not in the cache)
    prompt_length: int

    @property
    def committed_length(self) -> int:
        """Tokens whose K/V every layer holds (all but the pending one)."""
        return len(self.token_ids) - 1


@dataclass
class Proposal:
    """A chain of drafted tokens. Shapes: k = number of drafted tokens (0 allowed), V = vocabulary, H = hidden."""

    tokens: torch.Tensor  # [k] drafted token ids d_1..d_k (long, CPU); tree nodes in topological order
    parents: torch.Tensor | None = None  # [k] parent node index of each token, -1 = child of x; None = a chain
    logits: torch.Tensor | None = None  # [k, V] draft logits behind each d_i (q); None for deterministic drafts
    hidden: torch.Tensor | None = None  # [1, k+1, H] states after layer `hidden_layer` for [x, d_1..d_k]
    hidden_layer: int = 0  # layers [0, hidden_layer) already ran on [x, d_1..d_k] (their K/V is cached)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def is_tree(self) -> bool:
        return self.parents is not None and not is_chain(self.parents)

    @staticmethod
    def empty() -> "Proposal":
        return Proposal(tokens=torch.empty(0, dtype=torch.long))


class Drafter(ABC):
    """A virtual draft model. It proposes; it never decides what is accepted.

    Cache contract of `propose`: on return, either
      * every layer still holds exactly ``state.committed_length`` slots and ``proposal.hidden`` is None, or
      * layers ``[0, proposal.hidden_layer)`` (and the drafter's own extra cache layers) hold
        ``committed_length + k + 1`` slots, for ``[x, d_1..d_k]`` in that order at their chain or tree positions
        (``committed_length`` + depth), and ``proposal.hidden`` holds those tokens' states after that layer;
        all other target layers are untouched. The verifier then runs only the remaining layers.
    """

    name: str = "drafter"
    cache_layers: int = 0  # extra KV-cache layers the drafter's own blocks need (after the target's layers)
    prefill_layers: tuple[int, ...] = ()  # layers whose prompt hidden states `prefill` needs
    speculation: dict | None = None  # under a memory budget: the draft size bucket chosen for it, and why

    def prefill(self, state: DecodeState, hidden: dict[int, torch.Tensor]) -> None:
        """Called once after the prompt ran, with its states after each of ``prefill_layers`` (``[1, P, H]``)."""

    @abstractmethod
    def propose(self, state: DecodeState, max_tokens: int) -> Proposal:
        """Draft at most ``max_tokens`` tokens after ``state.token_ids``."""

    def observe(self, proposal: Proposal, num_accepted: int) -> None:
        """Told after each step how many drafted tokens the target accepted (for adaptive drafters)."""

    def counters(self) -> dict | None:
        """Per-generation counters to report (a scheduler's decisions and estimates); None: nothing to report."""
        return None

    def describe(self) -> dict:
        """Settings shown in stats and reports."""
        return {"name": self.name}
