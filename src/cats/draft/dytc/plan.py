"""DyTC's choice each step: the token counts of every cut of the near-free drafts (`FreeDrafts`) and `Planner`,
the part of `cats.draft.dytc.scheduler.DyTCDrafter` that keeps the estimates per option and picks the option and
length with the most expected tokens per predicted second (the objective in `cats.draft.dytc.scheduler`'s module
docstring). `Planner` is a mixin: it reads the estimates, the latency fits and the options that
`DyTCDrafter.__init__` sets up."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cats.draft.base import Proposal
from cats.draft.dytc.estimates import PLD_PRIORS, AcceptanceEstimate, WindowedAverage, expected_accepted
from cats.draft.dytc.hindsight import TREE_SIZES, best_cut

CURVE_TOKENS = 32  # the verification cost curve is predicted for up to this many tokens at once (more on demand)
SINGLE_EVERY = 60  # steps: at least one plain-decoding step this often, so the one-token cost stays measured
NONE, PLD = "none", "pld"


@dataclass
class FreeDrafts:
    """This step's near-free drafts as the planner sees them: the forward's token count (x included) for every cut,
    ``tokens[row, k]``: row 0 = no tree, row i = the recycling tree cut to ``TREE_SIZES[i - 1]`` nodes; column k =
    prompt lookup's first k tokens grafted in (-1: not available, e.g. a cut with the same nodes as a smaller one)."""

    ngram: int
    tokens: np.ndarray

    @classmethod
    def chain_only(cls, chain_tokens: int, ngram: int) -> "FreeDrafts":
        tokens = np.full((1 + len(TREE_SIZES), chain_tokens + 1), -1)
        tokens[0] = 1 + np.arange(chain_tokens + 1)
        return cls(ngram, tokens)

    def within(self, max_pass_tokens: int | None) -> "FreeDrafts":
        """These drafts with every cut of more than ``max_pass_tokens`` tokens unavailable (None: all kept)."""
        if max_pass_tokens is not None:
            self.tokens[self.tokens > max_pass_tokens] = -1
        return self

    @classmethod
    def of(cls, tree: Proposal, priority: list[int], chain: list[int], ngram: int) -> "FreeDrafts":
        free = cls.chain_only(len(chain), ngram)
        if not tree.num_tokens:
            return free
        children = {(parent, token): node for node, (parent, token) in
                    enumerate(zip(tree.parents.tolist(), tree.tokens.tolist()))}
        on_path, current = [], -1  # priorities of the tree nodes the chain runs through (increasing)
        for token in chain:
            current = children.get((current, token), -1)
            if current < 0:
                break
            on_path.append(priority[current])
        ranks, on_path = np.asarray(priority), np.asarray(on_path, dtype=int)
        lengths, seen = np.arange(len(chain) + 1), 0
        for row, size in enumerate(TREE_SIZES, start=1):
            nodes = int((ranks < size).sum())
            if nodes == seen:
                continue  # the same cut as a smaller size
            seen = nodes
            # chain tokens already in the cut: its first k tokens' nodes on the path with priority < size
            inside = np.concatenate([[0], np.cumsum(on_path < size)])
            shared = inside[np.minimum(lengths, len(on_path))]
            free.tokens[row] = 1 + nodes + lengths - shared
        return free


class Planner:
    """The estimates per option and the choice of option and length, as methods of `DyTCDrafter` (a mixin)."""

    # ------------------------------------------------------------------ estimates
    @staticmethod
    def _pld_prior(ngram: int) -> float:
        return PLD_PRIORS.get(ngram, max(PLD_PRIORS.values()))

    def _alpha_pld(self, ngram: int) -> AcceptanceEstimate:
        if ngram not in self.pld_acceptance:
            self.pld_acceptance[ngram] = AcceptanceEstimate(self._pld_prior(ngram), self.decay, self.window)
        return self.pld_acceptance[ngram]

    def _tree_yield(self, key: str) -> WindowedAverage:
        """A model tree option's mean accepted tokens per step. Prior: the per-token prior over the tree's depth."""
        if key not in self.tree_yield:
            option = self.options[key]
            depth = getattr(option.drafter, "depth", option.max_tokens)
            self.tree_yield[key] = WindowedAverage(expected_accepted(option.prior_acceptance, depth), self.decay,
                                                   self.window)
        return self.tree_yield[key]

    def _yield_rate(self, key: str, k: int, accepted: float) -> float:
        """Expected tokens per predicted second of drafting ``k`` tokens with ``key`` and verifying them, when a
        step is expected to accept ``accepted`` of them (model trees: measured yields per step)."""
        da, db = self._draft_line(key)
        return (1.0 + accepted) / (max(da + db * k, 0.0) + self._verify_time(k + 1))

    def _verify_curve(self, max_n: int) -> np.ndarray:
        """Predicted seconds of a target forward over n = 0..max_n tokens at the current context; before the first
        measurement, a flat curve of one (unit: a one-token forward). Computed once per step (and fit)."""
        key = (self.verify_cost.count, self._context)
        cached = self._curve
        if cached is None or cached[0] != key or len(cached[1]) <= max_n:
            size = max(max_n, CURVE_TOKENS)
            self._curve = cached = (key, self.verify_cost.curve(self._context, size))
        return cached[1]

    def _single_time(self) -> float:
        """Time of a one-token target forward (plain decoding)."""
        return float(self._verify_curve(1)[1])

    def _draft_line(self, key: str) -> tuple[float, float]:
        """``(a, b)`` of the drafting time ``a + b * k``; before any measurement, the prior cost ratio per token
        times a one-token forward."""
        model = self.draft_latency[key]
        if model.ready:
            return model.line()
        return 0.0, self.options[key].prior_cost * self._single_time()

    def _verify_time(self, n: int) -> float:
        return float(self._verify_curve(n)[max(n, 1)])

    def _fits(self, option) -> bool:
        """Whether ``option`` can draft within the planned pass: a tree's nodes and x must fit it whole (a chain is
        cut to it)."""
        return not option.tree or self.max_pass_tokens is None or option.max_tokens < self.max_pass_tokens

    def rate(self, key: str, k: int, alpha: float, lookahead: float = 0.0) -> float:
        """Expected tokens per predicted second of drafting ``k`` tokens with ``key`` (see `cats.draft.dytc.scheduler`)."""
        return self._best_length(key, k, alpha, lookahead, only=k)[1]

    def _best_length(self, key: str, max_k: int, alpha: float, lookahead: float = 0.0,
                     only: int | None = None) -> tuple[int, float]:
        """The length in ``1..max_k`` with the best rate (the first on ties) and that rate."""
        if key == NONE or max_k == 0:
            return 0, 1.0 / max(self._single_time(), 1e-6)
        verify = self._verify_curve(max_k + 1)
        da, db = self._draft_line(key)
        best_k, best, accepted, power = 0, -1.0, 0.0, 1.0
        for k in range(1, max_k + 1):
            power *= alpha
            accepted += power
            if only is not None and k != only:
                continue
            value = (1.0 + accepted + power * lookahead) / (max(da + db * k, 0.0) + verify[k + 1])
            if value > best:
                best_k, best = k, value
        return best_k, best

    def _may_pay(self, key: str, max_tokens: int) -> bool:
        """Whether model drafter ``key``, on its priors (its acceptance prior and its prior cost per token, both meant
        to be optimistic), would beat plain decoding at its best length: only then is it worth one try to measure
        it. (Resident Qwen2.5-Coder-1.5B on 2 cores: a layer-skip draft token costs 0.5-0.7 of a forward by its
        share of the weights, and its first tries took ~0.26 s a step, 1.3 s of a 96-token answer of 5 s.)"""
        option = self.options[key]
        if option.tree:
            value = self._yield_rate(key, option.max_tokens, self._tree_yield(key).ratio(self.step))
        else:
            value = self._best_length(key, min(option.max_tokens, max_tokens), self.acceptance[key].value(self.step))[1]
        return value > self._best_length(NONE, 0, 0.0)[1]

    def _free_plan(self, free: FreeDrafts) -> tuple[str, int, int, float]:
        """The best cut of this step's near-free drafts: ``(key, tree cut size, chain length, rate)``, key
        `NONE` (nothing), `PLD` (the chain alone) or the recycling option's key (a tree cut, the chain grafted)."""
        expected = self.hindsight.expected(self.step, free.ngram, free.tokens.shape[1] - 1)
        row, k, rate = best_cut(expected, free.tokens, self._verify_curve(int(free.tokens.max())))
        if row:
            return self.recycle.key, TREE_SIZES[row - 1], k, rate
        return (PLD if k else NONE), k, 0, rate

    def plan(self, max_tokens: int, lookup_tokens: int = 0, ngram: int = 0,
             free: FreeDrafts | None = None) -> tuple[str, int, int]:
        """The best (key, k, graft) now: no draft, the near-free drafts of ``free`` (prompt lookup's chain of k
        tokens: ``(pld, k, 0)``; token recycling's tree cut to k nodes with the chain's first ``graft`` tokens
        grafted in: ``(recycle, k, graft)``), or a model drafter at length k. Without ``free``, prompt lookup offers
        ``lookup_tokens`` tokens from an ``ngram``-token match and recycling nothing. Ties go to the earlier
        candidate: the near-free drafts (fewer tokens first), then model options in order, shorter."""
        if self.verify_cost.shape is None and self.verify_cost.ready and self.step - self._single_seen > SINGLE_EVERY:
            return NONE, 0, 0  # a flat prior is optimistic for more tokens, not for fewer: measure one token
        if self.verify_cost.ready:
            for key, option in self.options.items():  # try every model drafter once, so its cost is measured
                if (not option.hindsight and not self.draft_latency[key].ready and self._fits(option)
                        and min(option.max_tokens, max_tokens) >= 1 and self._may_pay(key, max_tokens)):
                    return key, option.max_tokens if option.tree else min(2, option.max_tokens, max_tokens), 0
        if free is None:
            free = FreeDrafts.chain_only(min(lookup_tokens, max_tokens), ngram).within(self.max_pass_tokens)
        key, k, graft_tokens, best = self._free_plan(free)
        choice = (key, k, graft_tokens)
        lookahead = self.lookahead_yield.ratio(self.step) if self.lookahead_tokens else 0.0
        for key, option in self.options.items():
            limit = min(option.max_tokens, max_tokens)
            if limit <= 0 or option.hindsight or not self._fits(option):
                continue
            if option.tree:
                k = option.max_tokens  # its node count (the budget only limits its depth)
                value = self._yield_rate(key, k, self._tree_yield(key).ratio(self.step))
            else:
                k, value = self._best_length(key, limit, self.acceptance[key].value(self.step), lookahead)
            if value > best:
                choice, best = (key, k, 0), value
        return choice


__all__ = ["CURVE_TOKENS", "NONE", "PLD", "SINGLE_EVERY", "FreeDrafts", "Planner"]
