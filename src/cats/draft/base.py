"""What every drafter (virtual draft model) hands to the decode loop, and what it may assume.

Notation, used across CATS: p = the target's distribution, q = a draft's distribution; ``x`` is the pending token
(the newest committed token, not yet in the KV cache); ``d_1 .. d_k`` are drafted tokens.

Greedy decoding and typical acceptance: drafters choose their tokens deterministically (``state.sampler`` is None).
Speculative sampling: ``state.sampler`` is set, and a drafter with a draft distribution *draws* its tokens from
q = ``sampler.probs(draft logits)`` with ``sampler`` (one generator per generation) and records each draw in
``Proposal.draws``; drafted tokens not covered by a `Draw` (prompt lookup, the cascade's corrections) are
deterministic candidates (one-hot q). `cats.verify.acceptance` states what a drafter may and may not base its choices on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from cats.model import KVCache, LayeredModel
from cats.sampling import Sampler
from cats.tree import is_chain


@dataclass
class DecodeState:
    """The decode loop's state as a drafter sees it (read-only, except that a drafter may write the cache as
    described in `Drafter.propose`)."""

    model: LayeredModel
    cache: KVCache
    token_ids: list[int]  # prompt + generated tokens; the last one, x, is pending (not in the cache)
    prompt_length: int
    sampler: Sampler | None = None  # set: draw drafts from q with it (speculative sampling); None: draft greedily
    final_hidden: torch.Tensor | None = None  # [k+1, H] the target's last-layer states (before its final norm) for
    # [x, d_1..d_k] of the latest verification, rows as its logits
    layer_hidden: dict[int, torch.Tensor | None] = field(default_factory=dict)  # keyed by the drafter's
    # `feature_layers`: the latest verification's states after each of them, rows as final_hidden

    @property
    def committed_length(self) -> int:
        """Tokens whose K/V every layer holds (all but the pending one)."""
        return len(self.token_ids) - 1


@dataclass
class Draw:
    """Candidates for the token after one node, drawn one after another *without replacement* from the draft
    distribution ``probs`` (q, warped like the target). Speculative sampling tests them in the order drawn.

    A candidate is a proposal node (verified by the target, so the walk can continue below it) or, where ``nodes``
    holds None, a token only: accepting it ends the step with that token (e.g. a tree node the drafter did not
    expand, or one the cascade pruned)."""

    parent: int  # the node whose next token they are: a proposal node index, -1 = x
    tokens: list[int]  # in the order drawn
    nodes: list[int | None]  # proposal node index of each candidate; None = not verified
    probs: torch.Tensor  # [V] q at the parent, exactly as drawn from

    @property
    def unverified(self) -> int:
        return sum(node is None for node in self.nodes)


@dataclass
class Proposal:
    """A chain of drafted tokens. Shapes: k = number of drafted tokens (0 allowed), V = vocabulary, H = hidden."""

    tokens: torch.Tensor  # [k] drafted token ids d_1..d_k (long, CPU); tree nodes in topological order
    parents: torch.Tensor | None = None  # [k] parent node index of each token, -1 = child of x; None = a chain
    logits: torch.Tensor | None = None  # [k, V] draft logits behind each d_i, when the draft has any (the
    # distribution a sampled token was drawn from is in `draws`)
    hidden: torch.Tensor | None = None  # [1, k+1, H] states after layer `hidden_layer` for [x, d_1..d_k]
    hidden_layer: int = 0  # layers [0, hidden_layer) already ran on [x, d_1..d_k] (their K/V is cached)
    draws: list[Draw] | None = None  # sampled drafts: how the tokens were drawn from q (see `Draw`); None: all
    # tokens were chosen deterministically

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_candidates(self) -> int:
        """Drafted tokens the acceptance rule may accept: the nodes plus the unverified candidates of draws."""
        return self.num_tokens + sum(draw.unverified for draw in self.draws or ())

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
    wants_features = False  # True: the loop hands it the target's final states of every committed token
    feature_layers: tuple[int, ...] = ()  # (wants_features) earlier target layers whose states it is handed too
    wants_target_logits = False  # True: the loop hands it the target's logits of every verified token

    def prefill(self, state: DecodeState, hidden: dict[int, torch.Tensor]) -> None:
        """Called once after the prompt ran, with its states after each of ``prefill_layers`` (``[1, P, H]``)."""

    @abstractmethod
    def propose(self, state: DecodeState, max_tokens: int) -> Proposal:
        """Draft at most ``max_tokens`` tokens after ``state.token_ids``."""

    def take_features(self, final_states: torch.Tensor, layer_states: dict[int, torch.Tensor] | None = None) -> None:
        """(``wants_features`` drafters) The target's last-layer states ``[n, H]`` (before its final norm) of the
        next n committed tokens: after each step, x and the accepted drafts, in order; ``layer_states`` their
        states after each of ``feature_layers``."""

    def take_target_logits(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """(``wants_target_logits`` drafters) The target's logits ``[n, V]`` after each of ``tokens`` (``[n]``): the
        last prompt token after the prefill, then x and every verified node (accepted or not) after each step."""

    def observe(self, proposal: Proposal, num_accepted: int) -> None:
        """Told after each step how many drafted tokens the target accepted (for adaptive drafters)."""

    def counters(self) -> dict | None:
        """Per-generation counters to report (a scheduler's decisions and estimates); None: nothing to report."""
        return None

    def describe(self) -> dict:
        """Settings shown in stats and reports."""
        return {"name": self.name}
