"""Early exit: the target's first ``layer`` layers plus a head (the target's own final norm + lm_head, or a
trained draft adapter) form a virtual draft model that shares the target's weights and KV cache.

Drafting writes K/V of layers ``[0, layer)`` for ``[x, d_1..d_k]``; the verifier reuses them and runs only the
deep layers ``[layer, N)`` on the returned hidden states, so no layer runs twice for the same token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cats.draft.base import DecodeState, Drafter, Proposal
from cats.errors import InvalidArgumentError
from cats.model import LayeredModel


def default_draft_layer(model: LayeredModel) -> int:
    """A shallow exit: one eighth of the depth (layer 3 of SmolLM2's 30), at least 1."""
    return max(1, model.num_layers // 8)


class EarlyExitDrafter(Drafter):
    """Chain drafts from layer ``layer``'s hidden state.

    Args:
        model: the target.
        layer: exit layer L_d, in ``[1, num_layers)``: drafts use layers ``[0, L_d)``.
        num_tokens: draft length k per step.
        head: hidden ``[..., H]`` -> logits ``[..., V]``; default the target's final norm + lm_head.
    """

    name = "early-exit"

    def __init__(
        self,
        model: LayeredModel,
        layer: int | None = None,
        num_tokens: int = 4,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        layer = default_draft_layer(model) if layer is None else layer
        if not 1 <= layer < model.num_layers:
            raise InvalidArgumentError(
                f"draft layer {layer} is outside [1, {model.num_layers}) for this {model.num_layers}-layer model"
            )
        if num_tokens < 1:
            raise InvalidArgumentError(f"early exit needs num_tokens >= 1, got {num_tokens}")
        self.model, self.layer, self.num_tokens = model, layer, num_tokens
        self.head = head or model.head

    def propose(self, state: DecodeState, max_tokens: int) -> Proposal:
        count = min(self.num_tokens, max_tokens)
        if count <= 0:
            return Proposal.empty()
        model, token = self.model, state.token_ids[-1]
        states, drafted, draft_logits = [], [], []
        for step in range(count + 1):  # the last pass only computes d_k's layer-L_d state for the verifier
            hidden = model.forward_layers(model.embed(torch.tensor([token])), 0, self.layer, state.cache)
            states.append(hidden)
            if step == count:
                break
            logits = self.head(hidden[0, -1])
            token = int(logits.argmax())
            drafted.append(token)
            draft_logits.append(logits)
        return Proposal(
            tokens=torch.tensor(drafted, dtype=torch.long),
            logits=torch.stack(draft_logits),
            hidden=torch.cat(states, dim=1),
            hidden_layer=self.layer,
        )

    def describe(self) -> dict:
        return {"name": self.name, "layer": self.layer, "num_tokens": self.num_tokens}
