"""Scoring a proposal with the full target (one forward).

Split as in vLLM: the drafter proposes, `score_proposal` runs the target, an acceptance rule (`cats.verify.acceptance`)
decides.
"""

from __future__ import annotations

import torch

from cats.draft.base import DecodeState, Proposal
from cats.tree import verification_inputs


def score_proposal(state: DecodeState, proposal: Proposal) -> torch.Tensor:
    """Target logits for ``[x, d_1..d_k]`` in one forward: ``[k+1, V]``; row 0 is p(. | prefix, x), row i + 1 is
    p(. | prefix, x, the path to node i). Trees use the tree attention mask and depth-based positions.

    Appends k+1 slots to every layer of the cache (the layers the drafter already ran keep theirs); leaves the
    final states ``[k+1, H]`` in ``state.final_hidden`` and those after the layers keyed in ``state.layer_hidden``
    under their keys."""
    model, committed = state.model, state.committed_length
    positions, attend = None, None
    if proposal.is_tree:
        positions, attend = verification_inputs(proposal.parents, committed)
    start = proposal.hidden_layer if proposal.hidden is not None else 0
    if proposal.hidden is not None:
        hidden = proposal.hidden
    else:
        hidden = model.embed(torch.cat([torch.tensor([state.token_ids[-1]]), proposal.tokens]))
    if any(layer <= start for layer in state.layer_hidden):
        raise RuntimeError(f"the verification starts after layer {start}: it cannot keep the states of layers "
                           f"{sorted(state.layer_hidden)}")
    hidden = model.forward_layers(hidden, start, model.num_layers, state.cache, position_ids=positions, attend=attend,
                                  capture=state.layer_hidden if state.layer_hidden else None)
    state.final_hidden = hidden[0]
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
