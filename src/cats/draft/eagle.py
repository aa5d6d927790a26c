"""Feature drafting (EAGLE-style): a trained feature draft adapter runs *after* the target, on the target's own final
features, so drafting touches no target layer at all. An EAGLE-3 head (`cats.model.eagle3`, method ``eagle3``)
drafts the same way from the fused states of three target layers in place of f_t (``g_t = fc([h_a, h_b, h_c])``),
and a node's next input is its parent's output before the head's final norm.

Notation: f_t is the target's final normed state at position t (what its lm_head reads; the loop hands the drafter
the states of every committed token), x_t the token at t. The adapter's cache entry at position t is built from
``[f_t, e(x_{t+1})]`` and its output estimates f_{t+1}, read out through the target's lm_head to draft x_{t+2}.

One step, with c committed tokens and x = x_c pending (not cached):

1. catch up: entries for positions ``fed .. c-1`` from the *true* features f_fed .. f_{c-1} (the tokens after them
   end with x) in one adapter forward; the last output is the estimate of f_c, whose head gives x's children.
2. grow a draft tree as in EAGLE-2 (`cats.draft.tree`): per depth, expand the ``tree_topk`` nodes with the
   highest cumulative draft log-probability; a node at depth d becomes the entry ``[its parent's estimated
   feature, its token]`` at position c + d - 1, attending to the true entries and its own ancestors. Then keep the
   ``total_tokens`` best nodes (``tree_topk=1``: a chain of ``depth`` tokens).
3. drop every draft entry: only true entries (positions < c) stay in the adapter's cache layer, and the target
   verifies the tree from layer 0 (the drafter ran no target layer).

After verification the loop hands over the target's final states of x and the accepted drafts
(`take_features`); the next step's catch-up feeds them.

Speculative sampling (``state.sampler`` set): a chain, each token *drawn* from the warped draft distribution
q and recorded as a one-candidate `Draw`; the confidence stop looks at q before the draw (lossless, see
`cats.verify.acceptance`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cats.draft.base import DecodeState, Drafter, Draw, Proposal
from cats.errors import InvalidArgumentError
from cats.model import LayeredModel
from cats.model.adapter import Adapter, AdapterError
from cats.model.eagle3 import Eagle3Head
from cats.tree import node_attend

TREE_TOPK, TOTAL_TOKENS, DEPTH = 4, 16, 5  # the default tree shape (as method tree's)


@dataclass
class _Node:
    token: int
    parent: int  # pool index of the parent node, -1 = x
    depth: int  # 1 = a child of x
    score: float  # cumulative draft log-probability of the path from x to this node
    slot: int | None = None  # adapter cache slot once expanded
    feature: torch.Tensor | None = None  # [H] the adapter's estimate of this node's final feature, once expanded


class FeatureDrafter(Drafter):
    """Draft trees (or chains) from a feature draft adapter.

    Args:
        model: the target.
        adapter: a feature draft adapter (``input="features"``, see `cats.model.adapter`) or an EAGLE-3 head.
        tree_topk: children per expanded node, and nodes expanded per depth (1 = a chain).
        total_tokens: nodes kept for verification.
        depth: maximum depth (draft length of a chain).
        threshold: stop expanding when the best frontier node's cumulative draft probability falls below it
            (sampling: stop a chain before a token whose q is below it).
    """

    name = "eagle"
    cache_layers = 1
    wants_features = True

    def __init__(self, model: LayeredModel, adapter: Adapter | Eagle3Head, tree_topk: int = TREE_TOPK,
                 total_tokens: int = TOTAL_TOKENS, depth: int = DEPTH, threshold: float = 0.0,
                 cache_layer: int | None = None):
        eagle3 = isinstance(adapter, Eagle3Head)
        if not eagle3 and (adapter.fc is None or adapter.config.input != "features"):
            raise AdapterError(f"method eagle needs a feature draft adapter (input 'features', trained with "
                               f"`cats train adapter --input features`); this one reads layer {adapter.config.layer}'s "
                               "hidden state: use it with early-exit or tree")
        _check_shape(tree_topk, total_tokens, depth)
        if not 0.0 <= threshold < 1.0:
            raise InvalidArgumentError(f"the draft confidence threshold must lie in [0, 1), got {threshold}")
        self.model, self.adapter = model, adapter
        self.tree_topk, self.total_tokens, self.depth, self.threshold = tree_topk, total_tokens, depth, threshold
        adapter.cache_layer = model.num_layers if cache_layer is None else cache_layer  # after the target's
        self.name = "eagle3" if eagle3 else "eagle"
        self.feature_layers = adapter.feature_layers if eagle3 else ()  # the aux layers: kept by each verification
        self.prefill_layers = (*self.feature_layers, model.num_layers)
        self._fed = 0  # adapter cache entries built from true features: positions [0, _fed)
        self._features: torch.Tensor | None = None  # [n, H] true features of positions _fed .. _fed + n - 1

    # ------------------------------------------------------------------ the target's features
    def prefill(self, state: DecodeState, hidden: dict[int, torch.Tensor]) -> None:
        self._fed, self._features = 0, None
        self.take_features(hidden[self.model.num_layers][0], {layer: hidden[layer][0] for layer in self.feature_layers})

    def take_features(self, final_states: torch.Tensor, layer_states: dict[int, torch.Tensor] | None = None) -> None:
        """The target's last-layer states ``[n, H]`` (before its final norm) of the next n committed positions, and
        (an EAGLE-3 head) their states after its aux layers."""
        if not self.feature_layers:
            self._features = append_features(self.model, self._features, final_states)
            return
        fused = self.adapter.features(layer_states)
        self._features = fused if self._features is None else torch.cat([self._features, fused])

    def _catch_up(self, state: DecodeState) -> torch.Tensor:
        """Feed the true features not yet in the adapter's cache; return the estimate of f_c (``[H]``)."""
        committed, layer = state.committed_length, self.adapter.cache_layer
        features = self._features
        if features is None or self._fed + features.shape[0] != committed:
            have = 0 if features is None else features.shape[0]
            raise RuntimeError(f"feature drafter out of step: {self._fed} fed + {have} pending features for "
                               f"{committed} committed tokens")
        state.cache.crop(self._fed, layers=[layer])
        next_ids = torch.tensor(state.token_ids[self._fed + 1 : committed + 1])
        out = self.adapter(self.adapter.feature_inputs(features, next_ids)[None], state.cache)
        self._fed, self._features = committed, None
        return out[0, -1]

    # ------------------------------------------------------------------ drafting
    def propose(self, state: DecodeState, max_tokens: int) -> Proposal:
        return self.propose_shaped(state, max_tokens, self.tree_topk, self.total_tokens, self.depth)

    def propose_shaped(self, state: DecodeState, max_tokens: int, tree_topk: int, total_tokens: int,
                       depth: int) -> Proposal:
        """`propose` with another tree shape (DyTC asks one drafter for chains and trees)."""
        max_depth = min(depth, max_tokens)
        if max_depth <= 0:
            return Proposal.empty()
        root = self._catch_up(state)
        try:
            if state.sampler is not None:
                return self._propose_drawn(state, root, max_depth)
            return self._propose_tree(state, root, max_depth, tree_topk, total_tokens)
        finally:  # only true entries stay: the verifier and the next catch-up never see draft entries
            state.cache.crop(self._fed, layers=[self.adapter.cache_layer])

    def _run_nodes(self, nodes: list[_Node], indices: list[int], root: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """Expand pool nodes ``indices`` in one adapter forward; return their draft logits over the adapter's
        vocabulary ``[m, V_d]``."""
        cache, layer, fed = state.cache, self.adapter.cache_layer, self._fed
        past = cache.length(layer)
        attend = node_attend(nodes, indices, past, visible=fed)
        parents = [root if nodes[i].parent < 0 else nodes[nodes[i].parent].feature for i in indices]
        positions = torch.tensor([fed - 1 + nodes[i].depth for i in indices])
        tokens = torch.tensor([nodes[i].token for i in indices])
        out = self.adapter(self.adapter.feature_inputs(torch.stack(parents), tokens)[None], cache,
                           position_ids=positions, attend=attend)[0]
        for row, index in enumerate(indices):
            nodes[index].slot, nodes[index].feature = past + row, out[row]
        return self.adapter.logits(out)

    def _children(self, nodes: list[_Node], logits: torch.Tensor, parent: int, parent_score: float, depth: int,
                  tree_topk: int) -> list[int]:
        log_probs = torch.log_softmax(logits.float(), -1)
        top = log_probs.topk(min(tree_topk, log_probs.numel()))
        tokens = self.adapter.token_ids(top.indices).tolist()
        added = []
        for log_prob, token in zip(top.values.tolist(), tokens):
            nodes.append(_Node(token, parent, depth, parent_score + log_prob))
            added.append(len(nodes) - 1)
        return added

    def _propose_tree(self, state: DecodeState, root: torch.Tensor, max_depth: int, tree_topk: int,
                      total_tokens: int) -> Proposal:
        nodes: list[_Node] = []
        frontier = self._children(nodes, self.adapter.logits(root), -1, 0.0, 1, tree_topk)
        for depth in range(1, max_depth):
            frontier = sorted(frontier, key=lambda i: (-nodes[i].score, i))[:tree_topk]
            if self.threshold and math.exp(nodes[frontier[0]].score) < self.threshold:
                break
            logits = self._run_nodes(nodes, frontier, root, state)
            frontier = [child for row, index in enumerate(frontier)
                        for child in self._children(nodes, logits[row], index, nodes[index].score, depth + 1, tree_topk)]
        # the best `total_tokens` nodes (a child never outscores its parent: the set is ancestor-closed); pool order
        # puts parents before children
        chosen = sorted(sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))[:total_tokens])
        position = {index: i for i, index in enumerate(chosen)}
        return Proposal(tokens=torch.tensor([nodes[i].token for i in chosen], dtype=torch.long),
                        parents=torch.tensor([position.get(nodes[i].parent, -1) for i in chosen], dtype=torch.long))

    def _propose_drawn(self, state: DecodeState, root: torch.Tensor, max_depth: int) -> Proposal:
        sampler, feature = state.sampler, root
        nodes: list[_Node] = []
        drafted, draft_logits, draws = [], [], []
        for step in range(max_depth):
            if step > 0:
                self._run_nodes(nodes, [step - 1], root, state)
                feature = nodes[step - 1].feature
            logits = self.adapter.full_logits(feature)
            q = sampler.probs(logits)
            if step > 0 and self.threshold and float(q.max()) < self.threshold:
                break
            token = sampler.sample(q)
            nodes.append(_Node(token, step - 1, step + 1, 0.0))
            draws.append(Draw(parent=step - 1, tokens=[token], nodes=[step], probs=q))
            drafted.append(token)
            draft_logits.append(logits)
        return Proposal(tokens=torch.tensor(drafted, dtype=torch.long), logits=torch.stack(draft_logits), draws=draws)

    def describe(self) -> dict:
        vocab = self.adapter.config.vocab_subset
        source = {"aux_layers": list(self.feature_layers)} if self.feature_layers else {"input": "features"}
        return {"name": self.name, "tree_topk": self.tree_topk, "total_tokens": self.total_tokens, "depth": self.depth,
                **({"threshold": self.threshold} if self.threshold else {}),
                "adapter": {**source, "vocab": len(vocab) if vocab else self.model.vocab_size}}


class FeatureDrafterView(Drafter):
    """One tree shape of a shared `FeatureDrafter` (DyTC offers its chains and its trees as two options): proposes
    through it; the shared drafter keeps the features and the cache layer."""

    def __init__(self, core: FeatureDrafter, tree_topk: int, total_tokens: int, depth: int):
        _check_shape(tree_topk, total_tokens, depth)
        self.core, self.tree_topk, self.total_tokens, self.depth = core, tree_topk, total_tokens, depth
        self.name = core.name if tree_topk > 1 else f"{core.name}-chain"

    def propose(self, state: DecodeState, max_tokens: int) -> Proposal:
        return self.core.propose_shaped(state, max_tokens, self.tree_topk, self.total_tokens, self.depth)

    def describe(self) -> dict:
        return {**self.core.describe(), "tree_topk": self.tree_topk, "total_tokens": self.total_tokens,
                "depth": self.depth}


def append_features(model: LayeredModel, pending: torch.Tensor | None, final_states: torch.Tensor) -> torch.Tensor:
    """The true features ``pending`` (``[n, H]``, or None) followed by those of the next committed positions: the
    target's final norm of their last-layer states ``final_states`` (what its lm_head reads)."""
    normed = model.decoder.norm(final_states)
    return normed if pending is None else torch.cat([pending, normed])


def _check_shape(tree_topk: int, total_tokens: int, depth: int) -> None:
    if tree_topk < 1 or total_tokens < 1 or depth < 1:
        raise InvalidArgumentError(f"tree_topk, total_tokens and depth must be >= 1, got {tree_topk}, {total_tokens}, "
                                   f"{depth}")
