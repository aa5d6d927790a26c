"""Early exit: the target's first ``layer`` layers plus a head form a virtual draft model that shares the
target's weights and KV cache. The head is the target's own final norm + lm_head, or a trained draft adapter
(one decoder block + norm, read out through the target's lm_head, optionally over a reduced vocabulary).

Drafting writes K/V of layers ``[0, layer)`` (and the adapter's own cache layer) for ``[x, d_1..d_k]``; the
verifier reuses them and runs only the deep layers ``[layer, N)``, so no layer runs twice for the same token.

With an *early-exit feature* adapter (input ``features+hidden``, see `cats.model.adapter`) the adapter also reads the
target's final features, as a feature draft (`cats.draft.eagle`) does: its entry at position t is
``[f_t, h_L(x_{t+1})]``. Each step first catches up over the committed tokens it has not seen, from the *true*
features the loop hands over (``take_features``) and the layer-L states of x and of the accepted drafts (kept from
the draft passes that computed them); each drafted d_i then gets the entry ``[the adapter's estimate of the feature
before it, h_L(d_i)]``. Draft entries are dropped after drafting: only true entries stay in the adapter's layer.

Greedy and typical acceptance: d_i is the draft's argmax. Speculative sampling (``state.sampler`` set): d_i is drawn
from q_i = the draft's warped distribution, recorded as a one-candidate `Draw`. The confidence stop looks at q_i
before d_i is drawn, so the draft length never depends on the drawn token itself (lossless, see `cats.verify.acceptance`).
"""

from __future__ import annotations

import torch

from cats.draft.base import DecodeState, Drafter, Draw, Proposal
from cats.draft.eagle import append_features
from cats.errors import InvalidArgumentError
from cats.model import LayeredModel
from cats.model.adapter import Adapter


def default_draft_layer(model: LayeredModel) -> int:
    """A shallow exit: one eighth of the depth (layer 3 of SmolLM2's 30), at least 1."""
    return max(1, model.num_layers // 8)


class EarlyExitDrafter(Drafter):
    """Chain drafts from layer ``layer``'s hidden state.

    Args:
        model: the target.
        layer: exit layer L_d, in ``[1, num_layers)``: drafts use layers ``[0, L_d)``. With an adapter, its layer.
        num_tokens: maximum draft length k per step.
        adapter: a trained draft adapter (see `cats.model.adapter`); None = the target's own norm + lm_head.
        threshold: confidence stop: after the first drafted token, drafting stops before a token whose draft
            probability is below this (0 = always draft ``num_tokens``).
    """

    name = "early-exit"

    def __init__(self, model: LayeredModel, layer: int | None = None, num_tokens: int = 4,
                 adapter: Adapter | None = None, threshold: float = 0.0):
        if adapter is not None and adapter.config.input == "features":
            raise InvalidArgumentError("this is a feature draft adapter (it reads the target's final features and "
                                       "no layer's state): use it with --method eagle")
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
        # an early-exit feature adapter: the loop hands over the target's final states of every committed token
        self.wants_features = adapter is not None and adapter.config.input == "features+hidden"
        if self.wants_features:
            self.prefill_layers = (layer, model.num_layers)
        self._fed = 0  # feature adapters: its cache holds true entries for positions [0, _fed)
        self._features: torch.Tensor | None = None  # [n, H] true normed features of positions _fed .. _fed + n - 1
        self._states: torch.Tensor | None = None  # [m, H] layer-L states of committed tokens after position _fed
        self._drafted: torch.Tensor | None = None  # [k, H] layer-L states of the latest proposal's drafts

    def prefill(self, state: DecodeState, hidden: dict[int, torch.Tensor]) -> None:
        """Give the adapter the prompt's layer-L states, so it attends over the whole context from step one (a
        feature adapter: keep them with the prompt's features for the first catch-up)."""
        if self.wants_features:
            self._fed, self._features, self._drafted = 0, None, None
            self._states = hidden[self.layer][0, 1:]  # tokens 1 .. P-1; the pending token's comes with step one
            self.take_features(hidden[self.model.num_layers][0])
        elif self.adapter is not None:
            self.adapter(hidden[self.layer], state.cache)

    def take_features(self, final_states: torch.Tensor, layer_states: dict[int, torch.Tensor] | None = None) -> None:
        """(Feature adapters) the target's last-layer states ``[n, H]`` of the next n committed tokens."""
        self._features = append_features(self.model, self._features, final_states)

    def _catch_up(self, state: DecodeState, pending: torch.Tensor) -> torch.Tensor:
        """Feed the adapter the true entries it lacks, ``[f_t, h_L(x_{t+1})]`` for t = _fed .. c-1 (``pending`` =
        h_L(x_c) ``[H]``, just computed); return its estimate of f_c (``[H]``)."""
        committed, features = state.committed_length, self._features
        kept = 0 if self._states is None else self._states.shape[0]
        accepted = committed - self._fed - 1 - kept  # drafts of the latest proposal the target accepted
        drafted = 0 if self._drafted is None else self._drafted.shape[0]
        if features is None or self._fed + features.shape[0] != committed or not 0 <= accepted <= drafted:
            have = 0 if features is None else features.shape[0]
            raise RuntimeError(f"early-exit feature drafter out of step: {self._fed} fed + {have} pending features "
                               f"and {kept} + {accepted} of {drafted} drafted token states for {committed} committed "
                               "tokens (it must draft every step)")
        parts = ([] if self._states is None else [self._states]) + (
            [self._drafted[:accepted]] if accepted else []) + [pending[None]]
        state.cache.crop(self._fed, layers=[self.adapter.cache_layer])
        out = self.adapter(self.adapter.feature_inputs(features, torch.cat(parts))[None], state.cache)
        self._fed, self._features, self._states, self._drafted = committed, None, None, None
        return out[0, -1]

    def _draft_logits(self, hidden: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """Full-vocabulary logits ``[V]`` of the draft for the last position of ``hidden`` (``[1, 1, H]``)."""
        return self.node_logits(hidden, state.cache)[-1]

    def node_logits(self, hidden: torch.Tensor, cache, position_ids: torch.Tensor | None = None,
                    attend: torch.Tensor | None = None) -> torch.Tensor:
        """Full-vocabulary draft logits ``[T, V]`` for T tokens whose layer-L states are ``hidden`` (``[1, T, H]``);
        the adapter (if any) appends their slots to its cache layer, with the same positions and visibility."""
        rows = self.draft_rows(hidden, cache, position_ids, attend)
        return rows if self.adapter is None else self.adapter.widen(rows)

    def draft_rows(self, hidden: torch.Tensor, cache, position_ids: torch.Tensor | None = None,
                   attend: torch.Tensor | None = None) -> torch.Tensor:
        """`node_logits` over the draft's own vocabulary, ``[T, V_d]`` (the adapter's reduced one, else the whole)."""
        if self.adapter is None:
            return self.model.head(hidden[0])
        return self.adapter.logits(self.adapter(hidden, cache, position_ids, attend=attend)[0])

    def propose(self, state: DecodeState, max_tokens: int) -> Proposal:
        count = min(self.num_tokens, max_tokens)
        if count <= 0:
            return Proposal.empty()
        model, token, sampler = self.model, state.token_ids[-1], state.sampler
        states, drafted, draft_logits, draws = [], [], [], []
        estimate = None  # feature adapters: the adapter's estimate of the feature before `token`
        for step in range(count + 1):
            hidden = model.forward_layers(model.embed(torch.tensor([token])), 0, self.layer, state.cache)
            states.append(hidden)
            if step == count:  # the last pass only computes d_k's states (and adapter K/V) for the verifier
                if self.adapter is not None and not self.wants_features:
                    self.adapter(hidden, state.cache)
                break
            if self.wants_features:  # step 0: catch up (true entries); then a draft entry per drafted token
                estimate = (self._catch_up(state, hidden[0, 0]) if step == 0 else self.adapter(
                    self.adapter.feature_inputs(estimate[None], hidden[0])[None], state.cache)[0, -1])
                logits = self.adapter.full_logits(estimate)
            else:
                logits = self._draft_logits(hidden, state)
            if step > 0 and self.threshold > 0 and float(torch.softmax(logits.float(), -1).max()) < self.threshold:
                break  # confidence stop: x, d_1..d_step went through the draft layers; d_{step+1} is not drafted
            if sampler is None:
                token = int(logits.float().argmax())
            else:
                q = sampler.probs(logits)
                token = sampler.sample(q)
                draws.append(Draw(parent=step - 1, tokens=[token], nodes=[step], probs=q))
            drafted.append(token)
            draft_logits.append(logits)
        if self.wants_features:  # only true entries stay; keep the drafts' states for the next catch-up
            state.cache.crop(self._fed, layers=[self.adapter.cache_layer])
            self._drafted = torch.cat(states[1:], dim=1)[0] if len(states) > 1 else None
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
            info["adapter"] = {"block": self.adapter.config.block, "input": self.adapter.config.input,
                               "vocab": len(vocab) if vocab else self.model.vocab_size}
        return info
