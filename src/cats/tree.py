"""Token trees: nodes in topological order, each with a parent, verified in one forward.

Indexing used throughout: the verification input is ``[x, n_0, n_1, ..]`` where ``x`` is the pending token (the
root) and ``n_i`` are drafted nodes; ``parents[i]`` is the index of ``n_i``'s parent node, ``-1`` for children of
``x``. A chain of k tokens is ``parents = [-1, 0, 1, .., k-2]``.

Worked example: parents ``[-1, -1, 0, 2]`` is the tree x -> {n0, n1}, n0 -> n2 -> n3; depths ``[1, 1, 2, 3]``;
``ancestors(parents)`` row 3 (n3) is ``[1, 0, 1, 1]`` (n0, n2 and itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def chain_parents(length: int) -> torch.Tensor:
    return torch.arange(-1, length - 1, dtype=torch.long)


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node (children of x have depth 1): ``[k]``."""
    result: list[int] = []
    for parent in parents.tolist():
        if parent >= len(result):
            raise ValueError(f"parents {parents.tolist()} are not in topological order")
        result.append(1 if parent < 0 else result[parent] + 1)
    return torch.tensor(result, dtype=torch.long)


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """``[k, k]`` bool: entry (i, j) is True when node j is node i or one of its ancestors (x excluded)."""
    count = parents.numel()
    matrix = torch.eye(count, dtype=torch.bool)
    for i, parent in enumerate(parents.tolist()):
        if parent >= 0:
            matrix[i] |= matrix[parent]
    return matrix


def verification_attend(parents: torch.Tensor, past: int) -> torch.Tensor:
    """``[k+1, past+k+1]`` visibility for verifying ``[x, nodes]`` after ``past`` cached slots: every token sees the
    whole prefix, x sees itself, a node sees x, its ancestors and itself."""
    count = parents.numel()
    tree = torch.zeros(count + 1, count + 1, dtype=torch.bool)
    tree[:, 0] = True
    tree[1:, 1:] = ancestors(parents)
    return torch.cat([torch.ones(count + 1, past, dtype=torch.bool), tree], dim=1)


def verification_inputs(parents: torch.Tensor, past: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids ``[k+1]`` (``past`` + depth; x at depth 0) and visibility ``[k+1, past+k+1]`` for verifying
    ``[x, nodes]`` after ``past`` cached slots."""
    positions = past + torch.cat([torch.zeros(1, dtype=torch.long), depths(parents)])
    return positions, verification_attend(parents, past)


def is_chain(parents: torch.Tensor) -> bool:
    return bool(torch.equal(parents, chain_parents(parents.numel())))


def greedy_path(tokens: torch.Tensor, parents: torch.Tensor, target_choice: torch.Tensor) -> list[int]:
    """The longest root-to-node path whose every token equals the target's choice at its parent.

    ``target_choice[0]`` is the target's token after x, ``target_choice[i + 1]`` after node i. Siblings carry
    distinct tokens, so at most one child can match. Returns node indices from the root down."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents.tolist()):
        children.setdefault(parent, []).append(node)
    path, current = [], -1
    token_list = tokens.tolist()
    while True:
        wanted = int(target_choice[current + 1])
        match = next((c for c in children.get(current, []) if token_list[c] == wanted), None)
        if match is None:
            return path
        path.append(match)
        current = match


# ------------------------------------------------------------------------------------ growing a draft tree
@dataclass
class TreeNode:
    """A drafted node of a tree as it grows (the nodes of a tree are a pool, a list indexed by these numbers)."""

    token: int
    parent: int  # pool index of the parent node, -1 = x
    depth: int
    score: float  # cumulative draft log-probability of the path from x to this node
    parent_row: int = -1  # row of the draft-logits table holding the distribution this node was drawn from
    slot: int | None = None  # cache slot once the node ran through the draft layers (it was expanded)
    hidden: torch.Tensor | None = None  # [H] its state after layer L_d, once computed


def add_top_children(nodes: list[TreeNode], logits: torch.Tensor, parents: list[int], depth: int, topk: int,
                     first_row: int = 0, token_ids=None) -> list[int]:
    """Add the ``topk`` most likely children of each of ``parents`` (pool indices, -1 = x; their draft logits are
    the rows of ``logits``, table rows ``first_row ..``) to the pool, in one batched log-softmax and top-k; return
    the children's pool indices. ``token_ids`` maps the logits' columns to token ids (a draft vocabulary's); a
    child with no probability left (-inf: a soft-capped head, or a token outside a draft vocabulary) is left out."""
    log_probs = torch.log_softmax(logits.float(), -1)
    top = log_probs.topk(min(topk, log_probs.shape[-1]), dim=-1)
    tokens = top.indices if token_ids is None else token_ids(top.indices)
    added = []
    for row, (parent, values, ids) in enumerate(zip(parents, top.values.tolist(), tokens.tolist())):
        parent_score = nodes[parent].score if parent >= 0 else 0.0
        for log_prob, token in zip(values, ids):
            if log_prob == float("-inf"):
                continue
            nodes.append(TreeNode(token, parent, depth, parent_score + log_prob, first_row + row))
            added.append(len(nodes) - 1)
    return added


def node_attend(nodes: list, indices: list[int], past: int, visible: int) -> torch.Tensor:
    """The mask (``[m, past + m]``) of pool nodes ``indices`` run together after ``past`` cache slots: each sees the
    first ``visible`` slots (the committed tokens and x), its ancestors' slots and its own. ``nodes``: a pool of
    nodes with a ``parent`` (pool index, -1 = x) and, once expanded, a ``slot`` (`TreeNode`, or a feature draft's)."""
    attend = torch.zeros(len(indices), past + len(indices), dtype=torch.bool)
    attend[:, :visible] = True
    for row, index in enumerate(indices):
        attend[row, past + row] = True
        parent = nodes[index].parent
        while parent >= 0:
            attend[row, nodes[parent].slot] = True
            parent = nodes[parent].parent
    return attend
