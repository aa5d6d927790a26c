"""Early exit: the target's first ``layer`` layers plus a head form a virtual draft model that shares the
target's weights and KV cache. The head is the target's own final norm + lm_head, or a trained draft adapter
(one decoder block + norm, read out through the target's lm_head, optionally over a reduced vocabulary).

Drafting writes K/V of layers ``[0, layer)`` (and the adapter's own cache layer) for ``[x, d_1..d_k]``; the
verifier reuses them and runs only the deep layers ``[layer, N)``, so no layer runs twice for the same token.

Greedy and typical acceptance: d_i is the draft's argmax. Speculative sampling (``state.sampler`` set): d_i is drawn
from q_i = the draft's warped distribution, recorded as a one-candidate `Draw`. The confidence stop looks at q_i
before d_i is drawn, so the draft length never depends on the drawn token itself (lossless, see `cats.acceptance`).
"""

from __future__ import annotations

import torch

from cats.draft.adapter import Adapter
from cats.draft.base import DecodeState, Draw, Drafter, Proposal
from cats.errors import InvalidArgumentError
from cats.model import LayeredModel


def default_draft_layer(model: LayeredModel) -> int:
    """A shallow exit: one eighth of the depth (layer 3 of SmolLM2's 30), at least 1."""
    return max(1, model.num_layers // 8)


class EarlyExitDrafter(Drafter):
    """Chain drafts from layer ``layer``'s hidden state.

    Args:
        model: the target.
        layer: exit layer L_d, in ``[1, num_layers)``: drafts use layers ``[0, L_d)``. With an adapter, its layer.
        num_tokens: maximum draft length k per step.
        adapter: a trained draft adapter (see `cats.draft.adapter`); None = the target's own norm + lm_head.
        threshold: confidence stop: after the first drafted token, drafting stops before a token whose draft
            probability is below this (0 = always draft ``num_tokens``).
    """

    name = "early-exit"

    def __init__(self, model: LayeredModel, layer: int | None = None, num_tokens: int = 4,
                 adapter: Adapter | None = None, threshold: float = 0.0):
        if adapter is not None and adapter.fc is not None:
            raise InvalidArgumentError("this is a feature draft adapter (it reads the target's final features): "
                                       "use it with --method eagle")
        if adapter is not None:
            if layer is not None and layer != adapter.config.layer:
                raise InvalidArgumentError(f"draft layer {layer} given, but the draft adapter was trained at layer "
                                           f"{adapter.config.layer}; drop --draft-layer or use a matching adapter")
            layer = adapter.config.layer
        layer = default_draft_layer(model) if layer is None else layer
        if not 1 <= layer < model.num_layers:
            raise InvalidArgumentError(
                f"draft layer {layer} is outside [1, {model.num_layers}) for this {model.num_layers}-layer model"
            )
        if num_tokens < 1:
            raise InvalidArgumentError(f"early exit needs num_tokens >= 1, got {num_tokens}")
        if not 0.0 <= threshold < 1.0:
            raise InvalidArgumentError(f"the draft confidence threshold must lie in [0, 1), got {threshold}")
        self.model, self.layer, self.num_tokens, self.threshold = model, layer, num_tokens, threshold
        self.adapter = adapter
        if adapter is not None:
            adapter.cache_layer = model.num_layers  # the first extra cache layer
        self.cache_layers = 1 if adapter is not None else 0
        self.prefill_layers = (layer,) if adapter is not None else ()

    def prefill(self, state: DecodeState, hidden: dict[int, torch.Tensor]) -> None:
        """Give the adapter the prompt's layer-L states, so it attends over the whole context from step one."""
        if self.adapter is not None:
            self.adapter(hidden[self.layer], state.cache)

    def _draft_logits(self, hidden: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """Full-vocabulary logits ``[V]`` of the draft for the last position of ``hidden`` (``[1, 1, H]``)."""
        return self.node_logits(hidden, state.cache)[-1]

    def node_logits(self, hidden: torch.Tensor, cache, position_ids: torch.Tensor | None = None,
                    attend: torch.Tensor | None = None) -> torch.Tensor:
        """Full-vocabulary draft logits ``[T, V]`` for T tokens whose layer-L states are ``hidden`` (``[1, T, H]``);
        the adapter (if any) appends their slots to its cache layer, with the same positions and visibility."""
        if self.adapter is None:
            return self.model.head(hidden[0])
        return self.adapter.full_logits(self.adapter(hidden, cache, position_ids, attend=attend)[0])

    def propose(self, state: DecodeState, max_tokens: int) -> Proposal:
        count = min(self.num_tokens, max_tokens)
        if count <= 0:
            return Proposal.empty()
        model, token, sampler = self.model, state.token_ids[-1], state.sampler
        states, drafted, draft_logits, draws = [], [], [], []
        for step in range(count + 1):
            hidden = model.forward_layers(model.embed(torch.tensor([token])), 0, self.layer, state.cache)
            states.append(hidden)
            if step == count:  # the last pass only computes d_k's states (and adapter K/V) for the verifier
                if self.adapter is not None:
                    self.adapter(hidden, state.cache)
                break
            logits = self._draft_logits(hidden, state)
            if step > 0 and self.threshold > 0 and float(torch.softmax(logits.float(), -1).max()) < self.threshold:
                break  # confidence stop: x, d_1..d_step went through the draft layers; d_{step+1} is not drafted
            if sampler is None:
                token = int(logits.argmax())
            else:
                q = sampler.probs(logits)
                token = sampler.sample(q)
                draws.append(Draw(parent=step - 1, tokens=[token], nodes=[step], probs=q))
            drafted.append(token)
            draft_logits.append(logits)
        return Proposal(
            tokens=torch.tensor(drafted, dtype=torch.long),
            logits=torch.stack(draft_logits),
            hidden=torch.cat(states, dim=1),
            hidden_layer=self.layer,
            draws=draws if sampler is not None else None,
        )

    def describe(self) -> dict:
        info = {"name": self.name, "layer": self.layer, "num_tokens": self.num_tokens}
        if self.threshold:
            info["threshold"] = self.threshold
        if self.adapter is not None:
            vocab = self.adapter.config.vocab_subset
            info["adapter"] = {"block": self.adapter.config.block, "vocab": len(vocab) if vocab else self.model.vocab_size}
        return info
