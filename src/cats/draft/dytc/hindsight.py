"""Hindsight yields of the near-free drafts (prompt lookup and token recycling).

Prompt lookup and token recycling draft without running a model layer, and deterministically: DyTC drafts both
every step, whatever it then verifies. Once the target has committed as many tokens as a draft is deep, what *any
part* of that draft would have had accepted is known exactly (greedy output, and sampled output with deterministic
drafts, does not depend on what was drafted): a tree's accepted tokens are its longest root path equal to the
committed tokens. So every step yields one `HindsightRecord` for every size the scheduler could have verified:

* the recycling tree cut to its ``m`` most probable nodes, for each ``m`` in `TREE_SIZES` (the template's nodes
  in the order of their prior probability; each cut is ancestor-closed);
* prompt lookup's chain cut to its first ``k`` tokens: ``min(k, a)`` for the full chain's accepted prefix ``a``;
* the two together (the chain grafted into the tree as one more branch): the longest matching root path of a union
  of trees is the longer of theirs, ``max(tree(m), min(k, a))``.

`HindsightYield` keeps the records of recent steps per prompt-lookup match class (0: no match, else how far back
the match holds: `cats.draft.dytc.estimates.match_class`) and
answers, for the current step's class, the expected accepted tokens of every (m, k) at once. With the
cost of verifying n tokens (`cats.draft.dytc.cost`), the scheduler then picks the (m, k) with the most expected
tokens per predicted second (`best_cut`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

TREE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)  # cuts of the recycling tree the scheduler chooses among (16: the template)
YIELD_DECAY, YIELD_WINDOW, YIELD_RECORDS = 0.98, 500, 200  # per match class: the newest record weighs 1, the one
# before 0.98, ...; at most 200 records, none older than 500 decode steps. Much slower than CAS-Spec's acceptance
# average (0.7, 20 steps): the estimate is a whole curve over (cut, length) chosen by its maximum, which a handful of
# records makes a noisy choice, and the bursts of prompt lookup are told apart by the match classes (a loop matches
# far back) rather than by recency. Replaying the hindsight records of 128 Spec-Bench questions outside the
# evaluation set: 0.98 / 500 gave 1.07-1.10x prompt lookup's mean per-question speed
# where 0.9 / 60 gave 1.03-1.06x; splitting the classes further (match in the prompt or the output, the previous
# step's yield, the generation's share of long copies) or weighting earlier generations' records less did not help


def tree_accepts(tokens: list[int], parents: list[int], committed: list[int]) -> list[int]:
    """Per node, its depth if its root path equals the committed tokens after x (``committed[0]`` is the target's
    token after x, ``committed[d]`` after the node at depth d), else 0. Parents precede their children."""
    depth_of = [0] * len(tokens)
    for node, (token, parent) in enumerate(zip(tokens, parents)):
        depth = 1 if parent < 0 else (depth_of[parent] + 1 if depth_of[parent] else 0)
        depth_of[node] = depth if depth and depth <= len(committed) and committed[depth - 1] == token else 0
    return depth_of


def chain_accepts(chain: list[int], committed: list[int]) -> int:
    """Leading tokens of ``chain`` equal to ``committed``."""
    accepted = 0
    for token, target in zip(chain, committed):
        if token != target:
            break
        accepted += 1
    return accepted


@dataclass
class HindsightRecord:
    """One step's near-free drafts, kept until the committed tokens cover them."""

    ngram: int  # prompt lookup's match class this step (0: no match)
    before: int  # tokens (prompt + generated) when drafted: the root x is the last of them
    tree_tokens: list[int]
    tree_parents: list[int]
    tree_priority: list[int]  # each node's rank by prior probability (0: the most probable)
    chain: list[int]  # prompt lookup's continuation (empty: no match)

    def score(self, committed: list[int]) -> tuple[np.ndarray, int] | None:
        """(accepted tokens of the tree cut to each of `TREE_SIZES`, accepted prefix of the chain), given the tokens
        committed after x so far; None while the outcome is still open (some node or chain token just beyond the
        committed tokens has every ancestor accepted). So a draft is scored as soon as it is decided -- at the step
        after it was made, unless a whole branch was accepted -- not only once the committed tokens cover its
        depth: prompt lookup's hits come in bursts, and a late score would miss the burst."""
        covered = len(committed)
        chain = chain_accepts(self.chain, committed)
        if chain == covered and len(self.chain) > covered:
            return None
        depth_of = tree_accepts(self.tree_tokens, self.tree_parents, committed)
        for node, parent in enumerate(self.tree_parents):
            alive = parent < 0 if covered == 0 else (parent >= 0 and depth_of[parent] == covered)
            if alive:
                return None  # a node at depth covered + 1 below an accepted path: undecided
        by_size = np.zeros(len(TREE_SIZES))
        for depth, priority in zip(depth_of, self.tree_priority):
            if depth:
                for i, size in enumerate(TREE_SIZES):
                    if priority < size and depth > by_size[i]:
                        by_size[i] = depth
        return by_size, chain


class HindsightYield:
    """Scored records per prompt-lookup match class; the expected accepted tokens of every (tree cut, chain length).

    A class without records answers with its prior: one pseudo-record, older than any real one, in which the tree
    cut to m nodes accepts ``tree_prior[m]`` and the chain ``chain_prior[ngram]`` tokens per step (optimistic
    guesses, so each option is tried: measurement decides)."""

    def __init__(self, tree_prior: dict[int, float] | None = None, chain_prior: dict[int, float] | None = None,
                 decay: float = YIELD_DECAY, window: int = YIELD_WINDOW):
        self.decay, self.window = decay, window
        self.tree_prior = np.array([(tree_prior or {}).get(size, 0.0) for size in TREE_SIZES])
        self.chain_prior = dict(chain_prior or {})
        self.records: dict[int, deque[tuple[int, np.ndarray, int]]] = {}  # (step, tree cuts, chain)

    def observe(self, step: int, ngram: int, tree: np.ndarray, chain: int) -> None:
        self.records.setdefault(ngram, deque(maxlen=YIELD_RECORDS)).append((step, np.asarray(tree, dtype=float), chain))

    def _recent(self, step: int, ngram: int) -> list[tuple[int, np.ndarray, int]]:
        records = self.records.get(ngram)
        if records is None:
            return []
        while records and records[0][0] <= step - self.window:
            records.popleft()
        return list(records)

    def count(self, step: int, ngram: int) -> int:
        return len(self._recent(step, ngram))

    def expected(self, step: int, ngram: int, max_chain: int) -> np.ndarray:
        """``[1 + len(TREE_SIZES), max_chain + 1]``: row 0 = no tree, row i = the tree cut to ``TREE_SIZES[i-1]``
        nodes; column k = the chain's first k tokens; entry = expected accepted tokens per step (records of the
        last ``window`` steps at ``step``)."""
        recorded = self._recent(step, ngram)
        trees = np.zeros((len(recorded) + 1, 1 + len(TREE_SIZES)))
        chains = np.zeros(len(recorded) + 1)
        trees[0, 1:] = self.tree_prior  # the prior: the oldest record
        chains[0] = self.chain_prior.get(ngram, 0.0) if ngram else 0.0
        for i, (_, tree, chain) in enumerate(recorded, start=1):
            trees[i, 1:], chains[i] = tree, chain
        weights = self.decay ** np.arange(len(recorded), -1, -1, dtype=float)  # newest last, weight 1
        lengths = np.arange(max_chain + 1)
        chain_part = np.minimum(chains[:, None], lengths[None, :])  # [records, k]
        both = np.maximum(trees[:, :, None], chain_part[:, None, :])  # [records, cuts, k]
        return np.tensordot(weights, both, axes=1) / weights.sum()


def best_cut(expected: np.ndarray, tokens: np.ndarray, cost: np.ndarray) -> tuple[int, int, float]:
    """The (tree-cut row, chain length) with the most expected tokens per second, ``(1 + expected) / cost[tokens]``,
    where ``tokens[row, k]`` is the forward's token count (x included; -1 where the option is unavailable). Ties go
    to fewer tokens (the first in row-major order after sorting by tokens). Returns (row, k, rate)."""
    valid = tokens > 0
    rate = np.where(valid, (1.0 + expected) / cost[np.where(valid, tokens, 1)], -1.0)
    best = rate.max()
    candidates = np.argwhere(rate >= best - 1e-12)
    row, k = min(candidates.tolist(), key=lambda rk: (tokens[rk[0], rk[1]], rk[0], rk[1]))
    return int(row), int(k), float(best)


__all__ = ["HindsightRecord", "HindsightYield", "TREE_SIZES", "best_cut", "chain_accepts", "tree_accepts"]
