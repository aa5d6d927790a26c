"""Token recycling (Luo et al., 2024, "Turning Trash into Treasure"): a training-free, near-free draft made of the
target's own discarded candidates.

Every verification forward computes the target's next-token distribution after each verified token -- x and every
drafted node -- and the decode loop keeps one token of each. Recycling keeps more: for every token id t a table row
holds the ``candidates`` most likely next tokens the target predicted after the latest verified occurrence of t
(an adjacency matrix ``[V, candidates]`` of int32: 1.5 MiB for SmolLM2's 49,152 tokens at 8 candidates). A draft is
a token tree read off the table from x along a static template of candidate ranks (``TreeTemplate``: the
``total_tokens`` paths of highest prior probability, as Medusa builds its sparse trees), verified in one forward with
tree attention; every verified row then refreshes its token's table row, accepted or not (`take_target_logits`).

The table starts empty and persists across generations of one drafter (the paper's hot start): it is a cache of
what the target said, never a guess about it, so the output stays the target's (greedy: token for token; sampling:
the tokens are deterministic candidates, see `cats.verify.acceptance`). Drafting runs no model layer, so it costs the same
under a memory budget and needs no resident layer.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from cats.draft.base import DecodeState, Drafter, Proposal
from cats.errors import InvalidArgumentError

CANDIDATES = 8  # table columns: top-8 next tokens per token id (the paper's k)
TOTAL_TOKENS, DEPTH = 16, 6  # default tree: verifying 16 nodes costs ~1.25 forwards on a 2-core CPU (bf16)
# prior probability that the candidate of each rank is the target's next token (rank 0 = its argmax back then);
# only the template's shape depends on it
RANK_PRIOR = (0.45, 0.15, 0.08, 0.05, 0.035, 0.025, 0.02, 0.015)


def table_bytes(vocab_size: int, candidates: int = CANDIDATES) -> int:
    """Bytes of the drafter's table (``[vocab_size, candidates]`` int32), which a memory budget must hold."""
    return vocab_size * candidates * np.dtype(np.int32).itemsize


class TreeTemplate:
    """The ``total_tokens`` rank paths (tuples of candidate ranks from x down) of highest prior probability, at most
    ``depth`` deep, in breadth-first order; ancestor-closed (a child's probability never exceeds its parent's)."""

    def __init__(self, total_tokens: int = TOTAL_TOKENS, depth: int = DEPTH, candidates: int = CANDIDATES,
                 rank_prior: tuple[float, ...] = RANK_PRIOR):
        if total_tokens < 1 or depth < 1 or not 1 <= candidates <= len(rank_prior):
            raise InvalidArgumentError(f"token recycling needs total_tokens >= 1, depth >= 1 and 1 <= candidates <= "
                                       f"{len(rank_prior)}, got {total_tokens}, {depth}, {candidates}")
        frontier = [(-rank_prior[rank], (rank,)) for rank in range(candidates)]
        heapq.heapify(frontier)
        chosen: list[tuple[int, ...]] = []
        while frontier and len(chosen) < total_tokens:
            score, path = heapq.heappop(frontier)
            chosen.append(path)
            if len(path) < depth:
                for rank in range(candidates):
                    heapq.heappush(frontier, (score * rank_prior[rank], path + (rank,)))
        self.paths = sorted(chosen, key=lambda path: (len(path), path))
        popped = {path: i for i, path in enumerate(chosen)}
        self.priority = [popped[path] for path in self.paths]  # rank by prior probability: the first m form the
        # template of m nodes, an ancestor-closed cut (a child is never more probable than its parent)
        index = {path: i for i, path in enumerate(self.paths)}
        self.parents = [index.get(path[:-1], -1) for path in self.paths]  # -1 = a child of x
        self.ranks = [path[-1] for path in self.paths]
        self.depths = [len(path) for path in self.paths]
        self.depth = max(self.depths)


class TokenRecyclingDrafter(Drafter):
    """Draft trees from the table of the target's recent candidates (module docstring).

    Args:
        vocab_size: the target's vocabulary size (table rows).
        total_tokens: nodes of the template tree (at most; nodes whose table entry is still empty are left out).
        depth: its maximum depth.
        candidates: table columns (candidates kept per token).
    """

    name = "recycle"
    wants_target_logits = True

    def __init__(self, vocab_size: int, total_tokens: int = TOTAL_TOKENS, depth: int = DEPTH,
                 candidates: int = CANDIDATES):
        self.template = TreeTemplate(total_tokens, depth, candidates)
        self.total_tokens, self.depth, self.candidates = total_tokens, depth, candidates
        self.table = np.full((vocab_size, candidates), -1, dtype=np.int32)

    def propose(self, state: DecodeState, max_tokens: int) -> Proposal:
        return self.propose_ranked(state, max_tokens)[0]

    def propose_ranked(self, state: DecodeState, max_tokens: int) -> tuple[Proposal, list[int]]:
        """The draft and each node's template priority (its rank by prior probability: the nodes of priority < m
        are the draft a template of m nodes would have made)."""
        if max_tokens <= 0:
            return Proposal.empty(), []
        template, table = self.template, self.table
        tokens: list[int] = []
        parents: list[int] = []
        priority: list[int] = []
        placed = [-1] * len(template.paths)  # template node -> proposal node (-1: left out)
        x = state.token_ids[-1]
        for node, (parent, rank, depth) in enumerate(zip(template.parents, template.ranks, template.depths)):
            if depth > max_tokens:
                break  # breadth-first order: every later node is at least as deep
            if parent >= 0 and placed[parent] < 0:
                continue  # its parent was left out
            token = int(table[x if parent < 0 else tokens[placed[parent]], rank])
            if token < 0:
                continue  # no candidate recorded yet
            placed[node] = len(tokens)
            tokens.append(token)
            parents.append(-1 if parent < 0 else placed[parent])
            priority.append(template.priority[node])
        proposal = Proposal(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))
        return proposal, priority

    def take_target_logits(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Refresh the table rows of ``tokens`` (``[n]``: x and the verified nodes) with the top candidates of the
        target's logits after each of them (``[n, V]``, rows as the tokens)."""
        top = logits.topk(self.candidates, dim=-1).indices.to(torch.int32).numpy()
        self.table[tokens.numpy()] = top

    def describe(self) -> dict:
        return {"name": self.name, "total_tokens": self.total_tokens, "depth": self.template.depth,
                "candidates": self.candidates}


def cut(proposal: Proposal, keep: list[bool]) -> Proposal:
    """The nodes of ``proposal``'s tree where ``keep`` is true (an ancestor-closed set), in their order."""
    new_index, tokens, parents = {}, [], []
    for node, (token, parent) in enumerate(zip(proposal.tokens.tolist(), proposal.parents.tolist())):
        if keep[node]:
            new_index[node] = len(tokens)
            tokens.append(token)
            parents.append(-1 if parent < 0 else new_index[parent])
    return Proposal(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))


def graft(proposal: Proposal, chain: list[int]) -> Proposal:
    """``proposal``'s tree with the token chain ``chain`` (after x) merged in from the root, as in a trie: it follows
    the nodes that already carry its tokens and appends the rest as new nodes (siblings keep distinct tokens)."""
    tokens = proposal.tokens.tolist()
    parents = proposal.parents.tolist() if proposal.parents is not None else list(range(-1, len(tokens) - 1))
    children = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens))}
    current = -1
    for token in chain:
        node = children.get((current, token))
        if node is None:
            node = len(tokens)
            tokens.append(token)
            parents.append(current)
            children[(current, token)] = node
        current = node
    return Proposal(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))
