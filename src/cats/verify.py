"""Scoring a proposal with the full target (one forward) and the acceptance rule.

Split as in vLLM: the drafter proposes, `score_proposal` runs the target, an acceptance rule decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cats.draft.base import DecodeState, Proposal


def score_proposal(state: DecodeState, proposal: Proposal) -> torch.Tensor:
    """Target logits for ``[x, d_1..d_k]`` in one forward: ``[k+1, V]``; row i is p(. | prefix, d_1..d_i).

    Appends k+1 slots to every layer of the cache (the layers the drafter already ran keep theirs)."""
    model = state.model
    if proposal.hidden is not None:
        hidden = model.forward_layers(proposal.hidden, proposal.hidden_layer, model.num_layers, state.cache,
                                      position_ids=_chain_positions(state, proposal))
    else:
        tokens = torch.cat([torch.tensor([state.token_ids[-1]]), proposal.tokens])
        hidden = model.forward_layers(model.embed(tokens), 0, model.num_layers, state.cache)
    return model.head(hidden[0])


def _chain_positions(state: DecodeState, proposal: Proposal) -> torch.Tensor:
    return torch.arange(state.committed_length, state.committed_length + proposal.num_tokens + 1)


@dataclass
class Verdict:
    """What the target decided about one proposal."""

    num_accepted: int  # drafted tokens kept, 0..k
    next_token: int  # the target's own token after them (a correction, or the bonus token if all were kept)


class GreedyAcceptance:
    """Keep the longest drafted prefix equal to the target's argmax, then the target's argmax after it.

    Worked example: drafts [5, 7, 9], target argmax per row [5, 7, 2, 4] -> accept 2 (5, 7), next token 2.
    The output is exactly what plain greedy decoding produces."""

    name = "greedy"

    def accept(self, proposal: Proposal, target_logits: torch.Tensor) -> Verdict:
        predicted = target_logits.argmax(dim=-1).cpu()  # [k+1]
        k = proposal.num_tokens
        matches = (predicted[:k] == proposal.tokens).to(torch.long)
        num_accepted = int(matches.cumprod(0).sum()) if k else 0
        return Verdict(num_accepted=num_accepted, next_token=int(predicted[num_accepted]))
