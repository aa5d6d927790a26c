"""Scoring a proposal with the full target (one forward) and the acceptance rule.

Split as in vLLM: the drafter proposes, `score_proposal` runs the target, an acceptance rule decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cats.draft.base import DecodeState, Proposal
from cats.tree import greedy_path, verification_inputs


def score_proposal(state: DecodeState, proposal: Proposal) -> torch.Tensor:
    """Target logits for ``[x, d_1..d_k]`` in one forward: ``[k+1, V]``; row 0 is p(. | prefix, x), row i + 1 is
    p(. | prefix, x, the path to node i). Trees use the tree attention mask and depth-based positions.

    Appends k+1 slots to every layer of the cache (the layers the drafter already ran keep theirs)."""
    model, committed = state.model, state.committed_length
    positions, attend = None, None
    if proposal.is_tree:
        positions, attend = verification_inputs(proposal.parents, committed)
    start = proposal.hidden_layer if proposal.hidden is not None else 0
    if proposal.hidden is not None:
        hidden = proposal.hidden
    else:
        hidden = model.embed(torch.cat([torch.tensor([state.token_ids[-1]]), proposal.tokens]))
    hidden = model.forward_layers(hidden, start, model.num_layers, state.cache, position_ids=positions, attend=attend)
    return model.head(hidden[0])


class TargetScorer:
    """Scores a proposal with the full target in one forward (`score_proposal`); the proposal is unchanged."""

    name = "target"
    cache_layers = 0  # extra KV-cache layers of its own (the cascade's shallow adapter has one)
    prefill_layers: tuple[int, ...] = ()

    def prefill(self, state: DecodeState, hidden: dict[int, torch.Tensor]) -> None:
        """Called once after the prompt ran, with its states after each of ``prefill_layers``."""

    def score(self, state: DecodeState, proposal: Proposal, max_tokens: int | None = None) -> tuple[Proposal, torch.Tensor]:
        """The proposal as verified, and the target's logits ``[k+1, V]`` for ``[x, its tokens]``. A scorer that
        adds nodes (the cascade) keeps every path at most ``max_tokens`` deep; this one adds none."""
        return proposal, score_proposal(state, proposal)

    def counters(self) -> dict | None:
        """Per-generation counters to report (None: nothing to report)."""
        return None


@dataclass
class Verdict:
    """What the target decided about one proposal."""

    accepted: list[int]  # indices of the drafted tokens kept, root to leaf (a chain: 0..n-1)
    next_token: int  # the target's own token after them (a correction, or the bonus token if all were kept)

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)


class GreedyAcceptance:
    """Keep the longest drafted prefix equal to the target's argmax, then the target's argmax after it.

    Worked example: drafts [5, 7, 9], target argmax per row [5, 7, 2, 4] -> accept 2 (5, 7), next token 2.
    Trees: the longest root-to-node path whose tokens equal the target's argmax at their parents (`greedy_path`).
    The output is exactly what plain greedy decoding produces."""

    name = "greedy"

    def accept(self, proposal: Proposal, target_logits: torch.Tensor) -> Verdict:
        predicted = target_logits.argmax(dim=-1).cpu()  # [k+1]
        if proposal.is_tree:
            path = greedy_path(proposal.tokens, proposal.parents, predicted)
            return Verdict(accepted=path, next_token=int(predicted[path[-1] + 1 if path else 0]))
        k = proposal.num_tokens
        matches = (predicted[:k] == proposal.tokens).to(torch.long)
        num_accepted = int(matches.cumprod(0).sum()) if k else 0
        return Verdict(accepted=list(range(num_accepted)), next_token=int(predicted[num_accepted]))
