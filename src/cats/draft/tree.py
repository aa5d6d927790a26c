"""Dynamic draft trees from an early-exit draft (the target's first L_d layers + a draft adapter or the target's
own head), grown as in EAGLE-2: per depth, expand the ``tree_topk`` nodes with the highest cumulative draft
log-probability (each gets its ``tree_topk`` most likely children), then keep the ``total_tokens`` best of all
drafted nodes as the tree to verify. Chain mode is ``tree_topk=1``.

Cache bookkeeping (the `Drafter` contract, trees included): expanded nodes run through layers ``[0, L_d)`` (and the
adapter) while drafting, so their K/V stay cached; after reranking, the slots of expanded nodes that did not make
the tree are dropped, and the selected leaves that were never expanded run through ``[0, L_d)`` once. Each layer
therefore runs exactly once per verified node, and the verifier continues at layer L_d.

Speculative sampling (``state.sampler`` set) grows the tree differently, so that recursive rejection sampling over
siblings stays lossless (see `cats.verify.acceptance`): every expanded node's ``tree_topk`` children are *drawn* without
replacement from the warped draft distribution q there (one `Draw` each); per depth the ``tree_topk`` drawn
children with the highest cumulative draft log-probability are expanded (at most ``total_tokens`` in all), and the
expanded nodes are exactly the verified ones. Whether a node is expanded is decided before its children are
drawn, and every drawn child stays a candidate of its parent's draw, verified or not, so no candidate's presence
depends on its own value. A drawn child that was not expanded can still be accepted, as the step's last token.
"""

from __future__ import annotations

import math

import torch

from cats.draft.base import DecodeState, Draw, Proposal
from cats.draft.early_exit import EarlyExitDrafter
from cats.errors import InvalidArgumentError
from cats.model import LayeredModel
from cats.model.adapter import Adapter
from cats.tree import TreeNode, add_top_children, node_attend


class TreeDrafter(EarlyExitDrafter):
    """Draft a token tree.

    Args:
        tree_topk: children per expanded node, and nodes expanded per depth.
        total_tokens: nodes kept for verification (the best by cumulative draft log-probability).
        depth: maximum depth of the tree (longest path, in tokens).
        threshold: stop expanding when the best frontier node's cumulative draft probability falls below it.
    Other arguments as for `EarlyExitDrafter`.
    """

    name = "tree"

    def __init__(self, model: LayeredModel, layer: int | None = None, adapter: Adapter | None = None,
                 tree_topk: int = 4, total_tokens: int = 16, depth: int = 5, threshold: float = 0.0):
        if adapter is not None and adapter.config.input != "hidden":
            raise InvalidArgumentError(f"this draft adapter reads the target's final features (input "
                                       f"{adapter.config.input!r}): trees draft with a layer-state adapter (draft/); "
                                       "use it with --method early-exit, or eagle for a feature/ adapter")
        super().__init__(model, layer=layer, num_tokens=depth, adapter=adapter, threshold=threshold)
        if tree_topk < 1 or total_tokens < 1 or depth < 1:
            raise InvalidArgumentError(f"tree_topk, total_tokens and depth must be >= 1, got {tree_topk}, "
                                       f"{total_tokens}, {depth}")
        self.tree_topk, self.total_tokens, self.depth = tree_topk, total_tokens, depth

    def _layers_with_draft_state(self) -> list[int]:
        layers = list(range(self.layer))
        return layers + ([self.adapter.cache_layer] if self.adapter is not None else [])

    def _run_nodes(self, nodes: list[TreeNode], indices: list[int], state: DecodeState,
                   full: bool = True) -> torch.Tensor:
        """Run the draft layers (and the adapter) on pool nodes ``indices`` at once; record slots and states; return
        their draft logits ``[m, V]`` (``full=False``: ``[m, V_d]`` over the draft vocabulary)."""
        model, cache = self.model, state.cache
        past, committed = cache.length(0), state.committed_length
        attend = node_attend(nodes, indices, past, visible=committed + 1)  # x's slot: committed
        positions = torch.tensor([committed + nodes[i].depth for i in indices])
        tokens = torch.tensor([nodes[i].token for i in indices])
        hidden = model.forward_layers(model.embed(tokens), 0, self.layer, cache, position_ids=positions, attend=attend)
        for row, index in enumerate(indices):
            nodes[index].slot, nodes[index].hidden = past + row, hidden[0, row]
        rows = self.draft_rows if not full else self.node_logits
        return rows(hidden, cache, positions, attend)

    def propose(self, state: DecodeState, max_tokens: int) -> Proposal:
        max_depth = min(self.depth, max_tokens)
        if max_depth <= 0:
            return Proposal.empty()
        if state.sampler is not None:
            return self._propose_drawn(state, max_depth)
        model, cache, committed = self.model, state.cache, state.committed_length
        # depth 0: x itself
        root = model.forward_layers(model.embed(torch.tensor([state.token_ids[-1]])), 0, self.layer, cache)
        # draft logits of expanded nodes over the draft vocabulary, one row each; row 0 = x
        tables = [self.draft_rows(root, cache)]
        nodes: list[TreeNode] = []
        frontier = self._expand(nodes, tables[0], [-1], depth=1, first_row=0)
        for depth in range(1, max_depth):
            frontier = sorted(frontier, key=lambda i: (-nodes[i].score, i))[: self.tree_topk]
            if self.threshold and math.exp(nodes[frontier[0]].score) < self.threshold:
                break
            logits = self._run_nodes(nodes, frontier, state, full=False)
            first_row = sum(t.shape[0] for t in tables)
            tables.append(logits)
            frontier = self._expand(nodes, logits, frontier, depth + 1, first_row)
        # rerank: the best `total_tokens` nodes (a child never outscores its parent, so the set is ancestor-closed)
        chosen = sorted(sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))[: self.total_tokens])
        expanded = sorted((i for i in chosen if nodes[i].slot is not None), key=lambda i: nodes[i].slot)
        leaves = [i for i in chosen if nodes[i].slot is None]
        keep = torch.cat([torch.arange(committed + 1), torch.tensor([nodes[i].slot for i in expanded], dtype=torch.long)])
        cache.keep(keep, layers=self._layers_with_draft_state())
        for new_slot, index in enumerate(expanded):
            nodes[index].slot = committed + 1 + new_slot
        if leaves:
            self._run_nodes(nodes, leaves, state, full=False)
        order = expanded + leaves  # parents precede children: leaves hang below expanded nodes
        return self._proposal(nodes, order, tables, root, reduced=True)

    def _propose_drawn(self, state: DecodeState, max_depth: int) -> Proposal:
        """The tree for speculative sampling (module docstring): drawn children, verified = expanded nodes."""
        model, cache, committed, sampler = self.model, state.cache, state.committed_length, state.sampler
        root = model.forward_layers(model.embed(torch.tensor([state.token_ids[-1]])), 0, self.layer, cache)
        tables = [self.node_logits(root, cache)]
        nodes: list[TreeNode] = []  # every drawn child
        draws: list[tuple[int, list[int], torch.Tensor]] = []  # (parent pool index or -1, children, q)
        frontier = self._draw_children(nodes, draws, sampler.probs(tables[0][0]), -1, 0.0, 1, 0, sampler)
        verified: list[int] = []  # pool indices, in cache-slot order
        for depth in range(1, max_depth + 1):
            room = min(self.tree_topk, self.total_tokens - len(verified))
            frontier = sorted(frontier, key=lambda i: (-nodes[i].score, i))[:room]
            if not frontier or (depth > 1 and self.threshold and math.exp(nodes[frontier[0]].score) < self.threshold):
                break
            logits = self._run_nodes(nodes, frontier, state)
            verified += frontier
            if depth == max_depth:
                break
            first_row = sum(t.shape[0] for t in tables)
            tables.append(logits)
            probs = sampler.probs(logits)  # q of every frontier node at once
            frontier = [child for row, index in enumerate(frontier)
                        for child in self._draw_children(nodes, draws, probs[row], index, nodes[index].score, depth + 1,
                                                         first_row + row, sampler)]
        return self._proposal(nodes, verified, tables, root, draws)

    def _proposal(self, nodes: list[TreeNode], order: list[int], tables: list[torch.Tensor], root: torch.Tensor,
                  draws: list[tuple[int, list[int], torch.Tensor]] | None = None, reduced: bool = False) -> Proposal:
        """The proposal of the pool nodes ``order`` (parents before children) in that order; with ``draws`` (the
        drawn tree), how each parent's children were drawn, in proposal positions. ``reduced``: the tables hold
        logits over the draft vocabulary (widened to the whole vocabulary here, for the proposal's rows only)."""
        position = {index: i for i, index in enumerate(order)}
        logits = torch.cat(tables)[torch.tensor([nodes[i].parent_row for i in order], dtype=torch.long)]
        if reduced and self.adapter is not None:
            logits = self.adapter.widen(logits)
        return Proposal(
            tokens=torch.tensor([nodes[i].token for i in order], dtype=torch.long),
            parents=torch.tensor([position[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in order]),
            logits=logits,
            hidden=torch.cat([root, torch.stack([nodes[i].hidden for i in order])[None]], dim=1),
            hidden_layer=self.layer,
            draws=None if draws is None else [
                Draw(parent=position[parent] if parent >= 0 else -1, tokens=[nodes[c].token for c in children],
                     nodes=[position.get(c) for c in children], probs=q) for parent, children, q in draws],
        )

    def _draw_children(self, nodes: list[TreeNode], draws: list, q: torch.Tensor, parent: int, parent_score: float,
                       depth: int, parent_row: int, sampler) -> list[int]:
        """Draw ``tree_topk`` children of a node without replacement from ``q`` (the warped draft distribution
        there); add them to the pool and their draw to ``draws``; return their pool indices."""
        tokens = sampler.draw(q, self.tree_topk)
        log_q = torch.log(q[tokens].double()).tolist()
        added = []
        for token, log_prob in zip(tokens, log_q):
            nodes.append(TreeNode(token, parent, depth, parent_score + log_prob, parent_row))
            added.append(len(nodes) - 1)
        draws.append((parent, added, q))
        return added

    def _expand(self, nodes: list[TreeNode], logits: torch.Tensor, parents: list[int], depth: int,
                first_row: int) -> list[int]:
        """`add_top_children` with this tree's ``tree_topk``, over the adapter's draft vocabulary if it has one."""
        return add_top_children(nodes, logits, parents, depth, self.tree_topk, first_row,
                                None if self.adapter is None else self.adapter.token_ids)

    def describe(self) -> dict:
        info = super().describe()
        info.update(name=self.name, tree_topk=self.tree_topk, total_tokens=self.total_tokens, depth=self.depth)
        info.pop("num_tokens", None)
        return info
