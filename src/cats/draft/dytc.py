"""DyTC scheduling (CAS-Spec's Dynamic Tree Cascade, for chains): each step, pick the drafter and the draft length
that maximise the expected tokens per unit of predicted time, from estimates learned while decoding.

Options each step (all from the target itself, or a trained draft adapter):

* no draft (plain decoding: 1 token for one 1-token target forward);
* the near-free drafts, which run no model layer: prompt lookup's continuation and token recycling's tree
  (`cats.draft.recycle`), both drafted every step *before* deciding. The scheduler verifies the best *cut* of them:
  the recycling tree cut to its m most probable template nodes (m in `cats.draft.hindsight.TREE_SIZES`, or none),
  with the chain's first k tokens grafted in as one more branch (k from 0 to all it found). Each (m, k) is judged
  by its expected accepted tokens -- estimated in *hindsight* from every earlier step's drafts, verified or not,
  per prompt-lookup match class (`match_class`: no match, or how far back the match holds) -- against the
  predicted cost of verifying that many tokens. Prompt lookup's acceptance is bursty (a held match often copies a
  long span, a loop repeats for good), which the per-class records capture and a geometric per-token rate does not
  (measured on Spec-Bench: with the geometric model DyTC drafted shorter than ``pld`` and reached 0.91x of it);
* each model drafter (layer-skip drafters, usually in a vertical cascade with prompt lookup under them, see
  `cats.draft.layer_skip`; the early exit through a trained draft adapter, chains and trees), at every length
  1..its maximum.

Estimates (all online):

* near-free yields (`cats.draft.hindsight`): once the committed tokens decide a step's drafts, what each cut would
  have had accepted is exact (greedy output, and sampled output with deterministic drafts, does not depend on what
  was drafted), so every step adds a record for every cut, chosen or not; up to 200 records of the last 500 steps per
  match class, weighted 0.98^age, give the expected accepted tokens of every (m, k);
* acceptance of model drafters: per drafter a per-token acceptance rate alpha, an exponential moving average with
  decay lambda = 0.7 over the observations of the last 20 decode steps (CAS-Spec's settings). Each step contributes
  its accepted tokens and its trials (accepted + 1 if a drafted token was rejected): the weighted geometric-model
  estimate. The prior (layer skip: the calibrated agreement; an adapter: its held-out agreement) enters as one
  pseudo-observation older than all others, and is all that is left when a drafter went unused for 20 steps: a
  drafter with a good prior is tried again then (exploration). Model trees track their accepted tokens per step;
* latency: the target forward over n tokens after T cached ones (`cats.draft.verify_cost`): its shape in n is
  measured once when the drafter is made (a forward over 1..32 tokens; on CPUs a few tokens cost about what one
  does, then each adds compute), and scaled online by recursive least squares with forgetting 0.98, with an
  attention term in T, from the time between `propose` and `observe` of every step. (A curve fitted online alone
  trapped itself: sizes it once judged slow were never tried again.) Without a measured shape (layers streamed
  from disk) it is flat, so untried sizes get tried, and a plain one-token step is taken at least every 60 steps so
  that the cheap end stays measured. Each model drafter's time ``a + b * k`` by the same least squares over the time spent
  in its `propose`; each is tried once (at length 2) as soon as a verification was timed, so that its cost is
  measured rather than assumed. Estimates persist across generations (and the questions of a `cats bench` run).

Objective (A*-style, as CAS-Spec): for drafter c at length k with acceptance alpha,

    rate(c, k) = (1 + sum_{i=1..k} alpha^i + alpha^k * Y) / (T_c(k) + T_verify(k + 1))

where the look-ahead term ``alpha^k * Y`` is the expected yield of the bottom draft (prompt lookup) after the
chain: when the whole chain is accepted, the prompt-lookup continuation of context + chain (up to
``lookahead_tokens``) is verified with it; Y is the moving average of the tokens that continuation yielded on the
steps the chain was fully accepted. After drafting, the continuation is attached only at the length that maximises
the same rate with its own n-gram acceptance (so it is skipped when it would not pay). No draft has rate
``1 / T_verify(1)``, so the scheduler drafts only when it expects to beat plain decoding.

With a draft adapter among the drafters, the adapter's own cache layer must hold every committed token: when
another drafter was chosen, the scheduler runs ``[x, drafts]`` through the target's first L layers and the adapter
itself and hands the verifier their states after layer L (the verifier then skips those layers), so nothing runs
twice. Output is unchanged (lossless): the target verifies every token.

Sampling: the options draft deterministically (their argmax chains and trees; no draws from q), so every candidate
is a one-hot candidate and the output is exactly plain sampling's for the same seed (`cats.acceptance`): the
scheduler's choices, which depend on measured time, cannot change what is generated.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from cats.draft.base import DecodeState, Drafter, Proposal
from cats.draft.prompt_lookup import LookupMatch, PromptLookupDrafter, lookup_match
from cats.draft.hindsight import TREE_SIZES, YIELD_DECAY, YIELD_WINDOW, HindsightRecord, HindsightYield, best_cut
from cats.draft.verify_cost import CostShape, VerifyCost, measure_shape, rls_step
from cats.draft.recycle import TokenRecyclingDrafter, cut, graft
from cats.errors import InvalidArgumentError
from cats.tree import is_chain, verification_inputs

DECAY, WINDOW = 0.7, 20  # CAS-Spec's acceptance moving average
FORGETTING = 0.98  # latency fits
# prompt-lookup acceptance before any observation, by matched n-gram length. Optimistic on purpose: a prior under
# which prompt lookup never beats plain decoding is never measured (1-gram matches at 0.3 were never tried on
# Spec-Bench, while their measured rate, where used, was ~0.5)
PLD_PRIORS = {1: 0.5, 2: 0.6, 3: 0.7, 4: 0.75, 8: 0.9}
MATCH_CLASSES = tuple(PLD_PRIORS)  # a match is classed by how far back it holds: 1, 2, 3, 4-7 or 8+ tokens
PLD_COST = 0.002  # a near-free draft's nominal cost per token, as a fraction of a one-token forward (token recycling's
# option; the scheduler treats both near-free drafts as drafted anyway and charges them nothing)
MAX_ALPHA = 0.98
CURVE_TOKENS = 32  # the verification cost curve is predicted for up to this many tokens at once (more on demand)
LOOKUP_TOKENS = 16  # prompt lookup's continuation, drafted every step; the hindsight records tell how much of it pays
# (replaying records of 128 Spec-Bench questions outside the evaluation set: 16 tokens gave 1.13x `pld`'s mean speed
# where 10, `pld`'s own length, gave 1.06x: loops and long copies go on past 10 tokens)
SINGLE_EVERY = 60  # steps: at least one plain-decoding step this often, so the one-token cost stays measured
RECYCLE_TOKENS = max(TREE_SIZES)  # token recycling's template in DyTC; each step verifies the cut that pays
RECYCLE_PRIOR = 0.5  # its per-token prior along the best path (optimistic, as for prompt lookup: measurement decides)
NONE, PLD = "none", "pld"


def match_class(match: LookupMatch) -> int:
    """The class of a prompt-lookup match for the estimates kept per class: 0 (no match) or the largest of
    `MATCH_CLASSES` not above the match's length (a longer match predicts a longer copy: a repeated phrase or a
    loop rather than a chance unigram)."""
    if not match.ngram:
        return 0
    return max(c for c in MATCH_CLASSES if c <= match.length)


def expected_accepted(alpha: float, k: int) -> float:
    """Expected accepted tokens of a k-token chain whose tokens are each accepted with probability alpha (given
    all before it were): ``sum_{i=1..k} alpha^i``."""
    if k <= 0 or alpha <= 0:
        return 0.0
    if alpha >= 1:
        return float(k)
    return alpha * (1 - alpha**k) / (1 - alpha)


class WindowedAverage:
    """Exponentially weighted average (newest weight 1, then ``decay``, ``decay^2`` ...) of the observations made in
    the last ``window`` steps, with a prior as one pseudo-observation older than all of them."""

    def __init__(self, prior: float, decay: float = DECAY, window: int = WINDOW):
        self.prior, self.decay, self.window = prior, decay, window
        self.history: deque[tuple[int, float, float]] = deque()  # (step, value, weight)

    def observe(self, step: int, value: float, weight: float = 1.0) -> None:
        self.history.append((step, value, weight))

    def _recent(self, step: int) -> list[tuple[int, float, float]]:
        while self.history and self.history[0][0] <= step - self.window:
            self.history.popleft()
        return list(self.history)

    def ratio(self, step: int) -> float:
        """``sum w_i value_i / sum w_i weight_i`` (prior: value = prior, weight = 1)."""
        recent = self._recent(step)
        numerator = denominator = 0.0
        factor = 1.0
        for _, value, weight in reversed(recent):
            numerator += factor * value
            denominator += factor * weight
            factor *= self.decay
        numerator += factor * self.prior
        denominator += factor
        return numerator / denominator

    def count(self, step: int) -> int:
        return len(self._recent(step))


class AcceptanceEstimate(WindowedAverage):
    """Per-token acceptance alpha of one drafter: each step adds its accepted tokens over its trials."""

    def observe_step(self, step: int, accepted: int, drafted: int) -> None:
        if drafted > 0:
            self.observe(step, float(accepted), float(accepted + (1 if accepted < drafted else 0)))

    def value(self, step: int) -> float:
        return min(self.ratio(step), MAX_ALPHA)


class LatencyModel:
    """``seconds ~ a + b * n`` by recursive least squares with forgetting.

    Fitted in units of the first observation (so the prior is scale-free): the first observation sets
    ``a, b`` to the prior shape ``b = slope_share * a`` through it; later ones update by RLS. A direction the data do
    not excite (n always the same) stays at the prior shape, and the covariance is capped so it cannot wind up."""

    def __init__(self, slope_share: float, forgetting: float = FORGETTING):
        self.slope_share, self.forgetting = slope_share, forgetting
        self.scale: float | None = None
        self.theta = np.zeros(2)
        self.P = np.eye(2)
        self.count = 0

    def observe(self, n: float, seconds: float) -> None:
        phi = np.array([1.0, float(n)])
        if self.scale is None:
            self.scale = max(seconds, 1e-9)
            a = 1.0 / (1.0 + self.slope_share * n)
            self.theta = np.array([a, self.slope_share * a])
            self.P0 = np.diag([1.0, max(self.slope_share, 0.05) ** 2]) * 10.0
            self.P = self.P0.copy()
        else:
            self.theta, self.P = rls_step(self.theta, self.P, self.P0, phi, seconds / self.scale, self.forgetting)
        self.count += 1

    @property
    def ready(self) -> bool:
        return self.scale is not None

    def predict(self, n: float) -> float:
        """Predicted seconds (at least a microsecond); only when `ready`."""
        a, b = self.line()
        return max(a + b * n, 1e-6)

    def line(self) -> tuple[float, float]:
        """``(a, b)`` in seconds; only when `ready`."""
        return float(self.theta[0]) * self.scale, float(self.theta[1]) * self.scale

    def coefficients(self) -> list[float] | None:
        """``[a, b]`` in seconds, or None before the first observation."""
        return None if self.scale is None else [float(c * self.scale) for c in self.theta]


@dataclass
class DraftOption:
    """A drafter the scheduler may choose: a chain drafter at any length up to ``max_tokens``, or (``tree``) a
    drafter of fixed-shape token trees of at most ``max_tokens`` nodes, whose mean accepted tokens per step the
    scheduler tracks instead of a per-token rate."""

    key: str  # its name in counters, e.g. "ls0.4<pld"
    drafter: Drafter  # a chain drafter is asked for exactly the chosen length; a tree drafter drafts its own shape
    max_tokens: int = 8
    prior_acceptance: float = 0.5  # per token (a tree: of its best path, over its depth)
    prior_cost: float = 0.5  # per drafted token, as a fraction of a one-token target forward
    tree: bool = False
    hindsight: bool = False  # a deterministic, near-free tree drafter (token recycling): drafted every step, and
    # on steps it is not chosen its draft is scored in hindsight against the tokens the target then commits


@dataclass
class _FreeDrafts:
    """This step's near-free drafts as the planner sees them: the forward's token count (x included) for every cut,
    ``tokens[row, k]``: row 0 = no tree, row i = the recycling tree cut to ``TREE_SIZES[i - 1]`` nodes; column k =
    prompt lookup's first k tokens grafted in (-1: not available, e.g. a cut with the same nodes as a smaller one)."""

    ngram: int
    tokens: np.ndarray

    @classmethod
    def chain_only(cls, chain_tokens: int, ngram: int) -> "_FreeDrafts":
        tokens = np.full((1 + len(TREE_SIZES), chain_tokens + 1), -1)
        tokens[0] = 1 + np.arange(chain_tokens + 1)
        return cls(ngram, tokens)

    @classmethod
    def of(cls, tree: Proposal, priority: list[int], chain: list[int], ngram: int) -> "_FreeDrafts":
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


@dataclass
class _Decision:
    key: str  # NONE, PLD or an option's key
    k: int  # chain tokens drafted
    extension: int = 0  # prompt-lookup tokens attached after the chain
    extension_ngram: int = 0
    ngram: int = 0  # prompt lookup chosen: the match class of its chain
    drafted_at: float = 0.0  # clock when drafting ended (verification starts)


class DyTCDrafter(Drafter):
    """Chooses, each step, no draft, the near-free drafts (prompt lookup and token recycling, cut to the sizes that
    pay), or one of the model drafters and a length (module docstring).

    Args:
        options: model drafters (at most one with its own cache layers, i.e. a trained draft adapter) and at most
            one near-free tree drafter (``hindsight=True``: token recycling).
        lookup: the prompt-lookup drafter used as an option and as the bottom look-ahead (None: neither).
        lookahead_tokens: longest prompt-lookup continuation attached after a model drafter's chain (0: none).
        decay, window: the acceptance moving average (CAS-Spec: 0.7, 20 steps).
        clock: a monotonic clock in seconds (tests pass a fake one).
        verify_shape: the measured cost of a target forward over 1..n tokens (`cats.draft.verify_cost.measure_shape`;
            None: flat until measured online).
    """

    name = "dytc"

    def __init__(self, options: Sequence[DraftOption], lookup: PromptLookupDrafter | None = None,
                 lookahead_tokens: int = 4, decay: float = DECAY, window: int = WINDOW,
                 forgetting: float = FORGETTING, clock: Callable[[], float] = time.perf_counter, features=None,
                 yield_decay: float = YIELD_DECAY, yield_window: int = YIELD_WINDOW,
                 verify_shape: CostShape | None = None):
        if not options and lookup is None:
            raise InvalidArgumentError("DyTC needs at least one drafter (prompt lookup or a model drafter)")
        keys = [option.key for option in options]
        if len(set(keys)) != len(keys) or NONE in keys or PLD in keys:
            raise InvalidArgumentError(f"DyTC drafter names must be distinct and not {NONE!r} or {PLD!r}: {keys}")
        if lookahead_tokens < 0 or not 0 < decay < 1 or window < 1 or not 0 < forgetting <= 1:
            raise InvalidArgumentError("DyTC needs lookahead_tokens >= 0, 0 < decay < 1, window >= 1, "
                                       "0 < forgetting <= 1")
        if not 0 < yield_decay <= 1 or yield_window < 1:
            raise InvalidArgumentError("DyTC needs 0 < yield_decay <= 1 and yield_window >= 1")
        for option in options:
            if option.max_tokens < 1 or not 0 <= option.prior_acceptance <= 1 or option.prior_cost < 0:
                raise InvalidArgumentError(f"DyTC option {option.key!r}: max_tokens >= 1, prior acceptance in "
                                           "[0, 1] and a non-negative prior cost are required")
        free_trees = [option for option in options if option.hindsight]
        if len(free_trees) > 1 or any(not isinstance(o.drafter, TokenRecyclingDrafter) for o in free_trees):
            raise InvalidArgumentError("DyTC holds at most one near-free tree option (hindsight=True), a token "
                                       "recycling drafter")
        with_cache = [option for option in options if option.drafter.cache_layers]
        if len({id(getattr(option.drafter, "adapter", None)) for option in with_cache}) > 1:
            raise InvalidArgumentError("DyTC can hold one draft adapter (drafters with their own cache layers must "
                                       "share it)")
        if features is not None and with_cache:
            raise InvalidArgumentError("DyTC holds either an early-exit draft adapter or a feature draft adapter")
        # the feature drafter (`cats.draft.feature`) shared by its options: it takes the target's final states of
        # every committed token whichever option drafted, and catches up on them when one of its options is chosen
        self.features = features
        self.wants_features = features is not None
        self.wants_target_logits = any(option.drafter.wants_target_logits for option in options)
        self.options = {option.key: option for option in options}
        self.recycle = free_trees[0] if free_trees else None  # the near-free tree option
        self.lookup, self.lookahead_tokens = lookup, lookahead_tokens if lookup is not None else 0
        self.decay, self.window, self.clock = decay, window, clock
        self.synced = with_cache[0].drafter if with_cache else None  # the adapter drafter kept in sync
        self.cache_layers = self.synced.cache_layers if self.synced else features.cache_layers if features else 0
        self.prefill_layers = tuple(sorted({layer for o in options for layer in o.drafter.prefill_layers}
                                           | set(features.prefill_layers if features else ())))
        # drafters whose prefill runs once: one per adapter, and any other drafter that asks for prompt states
        self._prefilled = ([self.synced] if self.synced else []) + ([features] if features else []) + [
            o.drafter for o in options if o.drafter.prefill_layers and not o.drafter.cache_layers]
        self.tree_yield: dict[str, WindowedAverage] = {}  # model trees: mean accepted tokens per step
        self.acceptance = {key: AcceptanceEstimate(o.prior_acceptance, decay, window)
                           for key, o in self.options.items() if not o.tree}
        self.pld_acceptance: dict[int, AcceptanceEstimate] = {}  # per-token rate (reports, the look-ahead)
        tree_prior = {}
        if self.recycle is not None:  # optimistic: the prior per-token rate along a cut's deepest path
            template = self.recycle.drafter.template
            for size in TREE_SIZES:
                depth = max(d for d, rank in zip(template.depths, template.priority) if rank < size)
                tree_prior[size] = expected_accepted(self.recycle.prior_acceptance, depth)
        chain_prior = {n: expected_accepted(p, lookup.num_tokens if lookup else 1) for n, p in PLD_PRIORS.items()}
        self.hindsight = HindsightYield(tree_prior, chain_prior, yield_decay, yield_window)
        self.lookahead_yield = WindowedAverage(0.0, decay, window)
        self.verify_cost = VerifyCost(forgetting, verify_shape)  # a target forward over n tokens after T cached ones
        self.draft_latency = {key: LatencyModel(0.05, forgetting) for key, o in self.options.items() if not o.hindsight}
        self.step = 0
        self._records: deque[HindsightRecord] = deque()  # near-free drafts, scored once the tokens cover them
        self._context = 0  # tokens in the cache when the current step was planned
        self._single_seen = 0  # the latest step that verified one token (no draft)
        self._curve: tuple | None = None  # ((fit count, context), `_verify_curve`)
        self._state: DecodeState | None = None
        self._decision: _Decision | None = None
        self._reset_counters()

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

    def rate(self, key: str, k: int, alpha: float, lookahead: float = 0.0) -> float:
        """Expected tokens per predicted second of drafting ``k`` tokens with ``key`` (see module docs)."""
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

    def _free_plan(self, free: _FreeDrafts) -> tuple[str, int, int, float]:
        """The best cut of this step's near-free drafts: ``(key, tree cut size, chain length, rate)``, key
        `NONE` (nothing), `PLD` (the chain alone) or the recycling option's key (a tree cut, the chain grafted)."""
        expected = self.hindsight.expected(self.step, free.ngram, free.tokens.shape[1] - 1)
        row, k, rate = best_cut(expected, free.tokens, self._verify_curve(int(free.tokens.max())))
        if row:
            return self.recycle.key, TREE_SIZES[row - 1], k, rate
        return (PLD if k else NONE), k, 0, rate

    def plan(self, max_tokens: int, lookup_tokens: int = 0, ngram: int = 0,
             free: _FreeDrafts | None = None) -> tuple[str, int, int]:
        """The best (key, k, graft) now: no draft, the near-free drafts of ``free`` (prompt lookup's chain of k
        tokens: ``(pld, k, 0)``; token recycling's tree cut to k nodes with the chain's first ``graft`` tokens
        grafted in: ``(recycle, k, graft)``), or a model drafter at length k. Without ``free``, prompt lookup offers
        ``lookup_tokens`` tokens from an ``ngram``-token match and recycling nothing. Ties go to the earlier
        candidate: the near-free drafts (fewer tokens first), then model options in order, shorter."""
        if self.verify_cost.shape is None and self.verify_cost.ready and self.step - self._single_seen > SINGLE_EVERY:
            return NONE, 0, 0  # a flat prior is optimistic for more tokens, not for fewer: measure one token
        if self.verify_cost.ready:
            for key, option in self.options.items():  # try every model drafter once, so its cost is measured
                if not option.hindsight and not self.draft_latency[key].ready and min(option.max_tokens,
                                                                                     max_tokens) >= 1:
                    return key, option.max_tokens if option.tree else min(2, option.max_tokens, max_tokens), 0
        if free is None:
            free = _FreeDrafts.chain_only(min(lookup_tokens, max_tokens), ngram)
        key, k, graft_tokens, best = self._free_plan(free)
        choice = (key, k, graft_tokens)
        lookahead = self.lookahead_yield.ratio(self.step) if self.lookahead_tokens else 0.0
        for key, option in self.options.items():
            limit = min(option.max_tokens, max_tokens)
            if limit <= 0 or option.hindsight:
                continue
            if option.tree:
                k = option.max_tokens  # its node count (the budget only limits its depth)
                value = self._yield_rate(key, k, self._tree_yield(key).ratio(self.step))
            else:
                k, value = self._best_length(key, limit, self.acceptance[key].value(self.step), lookahead)
            if value > best:
                choice, best = (key, k, 0), value
        return choice

    # ------------------------------------------------------------------ the Drafter interface
    def prefill(self, state: DecodeState, hidden: dict[int, torch.Tensor]) -> None:
        self._begin(state)
        for drafter in self._prefilled:
            drafter.prefill(state, hidden)

    def propose(self, state: DecodeState, max_tokens: int) -> Proposal:
        if state is not self._state:
            self._begin(state)
        self.step += 1
        self._context = state.committed_length
        tokens = self._token_array(state)
        found, ngram = np.empty(0, dtype=np.int64), 0  # looked up every step (the choice needs it): not a draft cost
        if self.lookup is not None and max_tokens > 0:
            match = lookup_match(tokens, self.lookup.max_ngram, self.lookup.min_ngram,
                                 min(self.lookup.num_tokens, max_tokens))
            found, ngram = match.tokens, match_class(match)
        deterministic = replace(state, sampler=None)  # see the module docstring: sampling
        self._score_hindsight(state)
        tree, priority = Proposal.empty(), []
        if self.recycle is not None and max_tokens > 0:  # drafted every step (near-free), scored in hindsight
            tree, priority = self.recycle.drafter.propose_ranked(deterministic, max_tokens)
        chain = found.tolist()
        free = _FreeDrafts.of(tree, priority, chain, ngram)
        if tree.num_tokens or chain:
            self._records.append(HindsightRecord(ngram, len(state.token_ids), tree.tokens.tolist(),
                                                 tree.parents.tolist() if tree.num_tokens else [], priority, chain))
        start = self.clock()
        key, k, graft_tokens = self.plan(max_tokens, len(found), ngram, free)
        decision = _Decision(key, k, ngram=ngram if key == PLD else 0)
        if key == PLD:
            proposal = Proposal(tokens=torch.as_tensor(found[:k], dtype=torch.long))
        elif self.recycle is not None and key == self.recycle.key:
            proposal = cut(tree, [rank < k for rank in priority]) if tree.num_tokens else Proposal.empty()
            if graft_tokens:
                proposal = graft(proposal, chain[:graft_tokens])
            decision.k = proposal.num_tokens
        elif key != NONE:
            proposal = self.options[key].drafter.propose(deterministic, max_tokens if self.options[key].tree else k)
            decision.k = proposal.num_tokens
        if key == NONE or not proposal.num_tokens:
            key, proposal = NONE, Proposal.empty()
            decision = _Decision(NONE, 0)
        drafted_at = self.clock()
        if key in self.draft_latency:
            self.draft_latency[key].observe(decision.k, drafted_at - start)
            if not self.options[key].tree:
                proposal = self._attach_lookahead(state, proposal, decision, self.options[key].drafter,
                                                  drafted_at - start, max_tokens)
        if self.synced is not None and proposal.hidden is None:
            proposal = self._run_synced(state, proposal)
        decision.drafted_at = drafted_at
        self._decision = decision
        self._counts["choices"][key] += 1
        self._counts["drafted"][key] += decision.k
        return proposal

    def _score_hindsight(self, state: DecodeState) -> None:
        """Score the near-free drafts the committed tokens now decide (module `cats.draft.hindsight`):
        each tree cut's and the chain's accepted tokens go to the yields of their prompt-lookup match class, the
        chain's to prompt lookup's per-token rate (the look-ahead's estimate)."""
        ids, waiting = state.token_ids, deque()
        for record in self._records:
            scored = record.score(ids[record.before:])
            if scored is None:
                waiting.append(record)
                continue
            tree, chain = scored
            self.hindsight.observe(self.step, record.ngram, tree, chain)
            if record.chain:
                self._alpha_pld(record.ngram).observe_step(self.step, chain, len(record.chain))
            self._counts["hindsight"] += 1
        self._records = waiting

    def take_features(self, final_states: torch.Tensor) -> None:
        self.features.take_features(final_states)

    def take_target_logits(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        for option in self.options.values():  # token recycling learns from every verification, whoever drafted
            if option.drafter.wants_target_logits:
                option.drafter.take_target_logits(tokens, logits)

    def observe(self, proposal: Proposal, num_accepted: int) -> None:
        decision, self._decision = self._decision, None
        if decision is None:
            return
        self.verify_cost.observe(proposal.num_tokens + 1, self._context, self.clock() - decision.drafted_at)
        if not proposal.num_tokens:
            self._single_seen = self.step
        chain = min(num_accepted, decision.k)
        self._counts["accepted"][decision.key] += chain
        if decision.key in (NONE, PLD) or self.options[decision.key].hindsight:
            return  # near-free drafts are scored in hindsight, chosen or not
        if self.options[decision.key].tree:
            self._tree_yield(decision.key).observe(self.step, float(num_accepted))
        else:
            self.acceptance[decision.key].observe_step(self.step, chain, decision.k)
            if num_accepted >= decision.k and self.lookahead_tokens:  # the look-ahead was reached
                gained = num_accepted - decision.k
                self.lookahead_yield.observe(self.step, float(gained))
                if decision.extension:
                    self._alpha_pld(decision.extension_ngram).observe_step(self.step, gained, decision.extension)
                    self._counts["lookahead_accepted"] += gained

    # ------------------------------------------------------------------ helpers
    def _attach_lookahead(self, state: DecodeState, proposal: Proposal, decision: _Decision, drafter: Drafter,
                          draft_s: float, max_tokens: int) -> Proposal:
        """Append the prompt-lookup continuation of context + chain at the length that maximises the rate."""
        room = min(self.lookahead_tokens, max_tokens - proposal.num_tokens)
        if room <= 0 or proposal.is_tree or (proposal.hidden is not None and not hasattr(drafter, "layer")):
            return proposal
        context = np.asarray(list(state.token_ids) + proposal.tokens.tolist())
        match = lookup_match(context, self.lookup.max_ngram, self.lookup.min_ngram, room)
        found, ngram = match.tokens, match_class(match)
        if not len(found):
            return proposal
        alpha = self.acceptance[decision.key].value(self.step)
        alpha_ext = self._alpha_pld(ngram).value(self.step)
        k = decision.k
        base = 1.0 + expected_accepted(alpha, k)
        best, length = base / (draft_s + self._verify_time(k + 1)), 0
        for m in range(1, len(found) + 1):
            value = (base + alpha**k * expected_accepted(alpha_ext, m)) / (draft_s + self._verify_time(k + 1 + m))
            if value > best:
                best, length = value, m
        if not length:
            return proposal
        extension = torch.as_tensor(found[:length], dtype=torch.long)
        decision.extension, decision.extension_ngram = length, ngram
        self._counts["lookahead_steps"] += 1
        self._counts["lookahead_tokens"] += length
        extended = replace(proposal, tokens=torch.cat([proposal.tokens, extension]))
        if proposal.logits is not None:  # the extension is deterministic: no draft distribution behind it
            extended.logits = None
        if proposal.hidden is not None:  # run the extension through the layers the drafter already ran
            position = state.committed_length + 1 + k
            extended.hidden = torch.cat([proposal.hidden, self._states(drafter, state, extension, position)], dim=1)
        return extended

    @staticmethod
    def _states(drafter, state: DecodeState, tokens: torch.Tensor, position: int,
                parents: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``tokens`` (a chain continuing at ``position``; with ``parents``, x and a tree's nodes) through an
        early-exit drafter's layers and its adapter (if any), appending their K/V; their states after its layer
        ``[1, T, H]``."""
        model, attend = state.model, None
        if parents is not None and not is_chain(parents):  # tree positions and attention, as the verifier's
            positions, attend = verification_inputs(parents, state.cache.length(0))
        else:
            positions = torch.arange(position, position + len(tokens))
        hidden = model.forward_layers(model.embed(tokens), 0, drafter.layer, state.cache, position_ids=positions,
                                      attend=attend)
        if drafter.adapter is not None:
            drafter.adapter(hidden, state.cache, positions, attend=attend)
        return hidden

    def _run_synced(self, state: DecodeState, proposal: Proposal) -> Proposal:
        """Keep the draft adapter's cache layer complete: run ``[x, drafts]`` (a chain or a tree, e.g. token
        recycling's) through its layers and the adapter and hand the verifier the states after its layer (the
        verifier skips those layers)."""
        tokens = torch.cat([torch.tensor([state.token_ids[-1]]), proposal.tokens])
        hidden = self._states(self.synced, state, tokens, state.committed_length, proposal.parents)
        return replace(proposal, hidden=hidden, hidden_layer=self.synced.layer)

    def _token_array(self, state: DecodeState) -> np.ndarray:
        """``state.token_ids`` as a numpy array, converting only the tokens added since the last step (within a
        generation tokens are only ever appended)."""
        ids, held = state.token_ids, self._held
        if len(ids) > len(self._buffer):
            grown = np.empty(max(2 * len(self._buffer), len(ids) + 256), dtype=np.int64)
            grown[:held] = self._buffer[:held]
            self._buffer = grown
        self._buffer[held:len(ids)] = ids[held:]
        self._held = len(ids)
        return self._buffer[: len(ids)]

    def _begin(self, state: DecodeState) -> None:
        """A new generation: its counters start at zero (the estimates carry over)."""
        self._state, self._decision = state, None
        self._records.clear()
        self._buffer, self._held = np.empty(0, dtype=np.int64), 0
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._counts = {"choices": Counter(), "drafted": Counter(), "accepted": Counter(), "hindsight": 0,
                        "lookahead_steps": 0, "lookahead_tokens": 0, "lookahead_accepted": 0}

    def counters(self) -> dict:
        """This generation's decisions (steps, drafted and accepted tokens per drafter, look-ahead use) and the
        current estimates (acceptance, the near-free drafts' yields, latency fits in seconds)."""
        counts = self._counts
        keys = [NONE, PLD] + list(self.options)
        return {
            "choices": {key: counts["choices"][key] for key in keys},
            "drafted": {key: counts["drafted"][key] for key in keys if key != NONE},
            "accepted": {key: counts["accepted"][key] for key in keys if key != NONE},
            "lookahead": {"steps": counts["lookahead_steps"], "tokens": counts["lookahead_tokens"],
                          "accepted": counts["lookahead_accepted"]},
            "hindsight_scored": counts["hindsight"],
            "estimates": {
                "acceptance": {key: round(est.value(self.step), 4) for key, est in self.acceptance.items()},
                "pld_acceptance": {str(n): round(est.value(self.step), 4)
                                   for n, est in sorted(self.pld_acceptance.items())},
                "near_free_yield": self._near_free_report(),
                "lookahead_yield": round(self.lookahead_yield.ratio(self.step), 4),
                "tree_yield": {key: round(y.ratio(self.step), 4) for key, y in self.tree_yield.items()},
                "verify_latency_s": self._verify_report(),
                "draft_latency_s": {key: _rounded(model.coefficients()) for key, model in self.draft_latency.items()},
            },
        }

    REPORTED_TOKENS = (1, 2, 4, 8, 12, 16, 24, 32)

    def _verify_report(self) -> dict | None:
        """Predicted seconds of a target forward over n tokens at the latest context, for a few n."""
        if not self.verify_cost.ready:
            return None
        curve = self._verify_curve(max(self.REPORTED_TOKENS))
        shape = self.verify_cost.shape
        return {"context": self._context, "by_tokens": {str(n): _rounded([curve[n]])[0] for n in self.REPORTED_TOKENS},
                "measured_shape": shape.to_dict() if shape is not None else None}

    def _near_free_report(self) -> dict:
        """Per prompt-lookup match class with records: expected accepted tokens per step of prompt lookup's chain
        (at its full length) and of each recycling tree cut alone."""
        report = {}
        chain = self.lookup.num_tokens if self.lookup is not None else 0
        for ngram in sorted(self.hindsight.records):
            expected = self.hindsight.expected(self.step, ngram, chain)
            entry = {"records": self.hindsight.count(self.step, ngram)}
            if ngram and chain:
                entry["pld"] = round(float(expected[0, chain]), 3)
            if self.recycle is not None:
                entry["recycle"] = {str(size): round(float(expected[i, 0]), 3) for i, size in enumerate(TREE_SIZES, 1)}
            report[str(ngram)] = entry
        return report

    def describe(self) -> dict:
        return {"name": self.name, "decay": self.decay, "window": self.window, "lookahead_tokens": self.lookahead_tokens,
                "lookup": self.lookup.describe() if self.lookup is not None else None,
                "options": {key: {"max_tokens": o.max_tokens, "prior_acceptance": round(o.prior_acceptance, 4),
                                  "prior_cost": round(o.prior_cost, 4), "drafter": o.drafter.describe()}
                            for key, o in self.options.items()}}


def draft_cost(model, layer_fraction: float) -> float:
    """Prior cost of one draft token as a fraction of a one-token target forward: the draft runs
    ``layer_fraction`` of the decoder's weights and the whole lm_head (weights read per token dominate on CPUs)."""
    layers = sum(p.numel() for p in model.layers.parameters())
    head = model.hf_model.lm_head.weight.numel()
    return (layer_fraction * layers + head) / (layers + head)


def make_dytc(model, sparsities: Sequence[float] = (0.4, 0.6), adapter=None, max_ngram: int = 3,
              num_tokens: int | None = None, lookahead_tokens: int = 4, tree_topk: int = 4, total_tokens: int = 16,
              depth: int = 5, feature_adapter=None, recycle: bool = True, progress: bool = True) -> DyTCDrafter:
    """The training-free hierarchy of CAS-Spec plus, optionally, a trained draft adapter:

    * prompt lookup (up to `LOOKUP_TOKENS` tokens, the scheduler picks how many to verify), also the bottom
      look-ahead;
    * token recycling (``recycle``, `cats.draft.recycle`): trees read off the table of the target's own recent
      candidates along a template of ``RECYCLE_TOKENS`` nodes, near-free like prompt lookup (its table learns from
      every verification, whichever option drafted); each step verifies the cut of tree and lookup chain that
      pays (module docstring);
    * for each sparsity s, a layer-skip drafter ``ls<s><pld`` whose own tokens prompt lookup proposes (vertical
      cascade); with two or more sparsities also ``ls<lowest><ls<highest><pld``, the densest drafter assisted by
      the sparsest;
    * with ``adapter``, the early exit through it: chains (``draft-adapter``) and dynamic trees of
      ``total_tokens`` nodes (``draft-tree``, shaped by ``tree_topk`` and ``depth`` as in method ``tree``);
    * or, with ``feature_adapter``, feature drafting (method ``eagle``): chains (``eagle-chain``) and trees
      (``eagle``), one drafter behind both.

    Model drafters draft up to ``num_tokens`` (default 8) tokens. Priors: a layer-skip drafter's calibrated
    agreement, the adapter's held-out agreement (0.6 if unknown); costs from the share of the weights a draft token
    runs through (`draft_cost`)."""
    from cats.draft.calibrate import load_or_calibrate
    from cats.draft.early_exit import EarlyExitDrafter
    from cats.draft.layer_skip import LayerSkipDrafter
    from cats.draft.tree_draft import TreeDrafter

    limit = num_tokens or 8
    if limit < 1:
        raise InvalidArgumentError(f"dytc needs num_tokens >= 1, got {limit}")
    lookup = PromptLookupDrafter(num_tokens=LOOKUP_TOKENS, max_ngram=max_ngram)
    bottom = PromptLookupDrafter(num_tokens=limit, max_ngram=max_ngram)
    options = [DraftOption("recycle", TokenRecyclingDrafter(model.vocab_size, total_tokens=RECYCLE_TOKENS),
                           RECYCLE_TOKENS, RECYCLE_PRIOR, PLD_COST, tree=True, hindsight=True)] if recycle else []
    calibrated = [load_or_calibrate(model, s, progress=progress) for s in sorted(sparsities)]
    for result in calibrated:
        drafter = LayerSkipDrafter(model, result.skip, num_tokens=limit, assist=bottom, sparsity=result.sparsity,
                                   agreement=result.agreement)
        options.append(DraftOption(drafter.label, drafter, limit, result.agreement,
                                   draft_cost(model, 1.0 - result.sparsity)))
    if len(calibrated) >= 2:
        dense, sparse = calibrated[0], calibrated[-1]
        helper = LayerSkipDrafter(model, sparse.skip, num_tokens=limit, assist=bottom, sparsity=sparse.sparsity,
                                  agreement=sparse.agreement)
        drafter = LayerSkipDrafter(model, dense.skip, num_tokens=limit, assist=helper, sparsity=dense.sparsity,
                                   agreement=dense.agreement)
        # about two tokens per dense forward: the sparse drafter's cost plus half the dense one's, per token
        cost = draft_cost(model, 1.0 - sparse.sparsity) + 0.5 * draft_cost(model, 1.0 - dense.sparsity)
        options.append(DraftOption(drafter.label, drafter, limit, dense.agreement, cost))
    # a tree runs its draft step on its expanded nodes only: about depth * tree_topk of total_tokens
    expanded = min(1.0, (depth * tree_topk + 1) / total_tokens)
    if adapter is not None:
        drafter = EarlyExitDrafter(model, adapter=adapter, num_tokens=limit)
        final = (adapter.config.training or {}).get("final_eval") or {}
        prior = float(final.get("agreement", 0.6))
        cost = draft_cost(model, (drafter.layer + 1) / model.num_layers)
        options.append(DraftOption("draft-adapter", drafter, limit, prior, cost))
        tree = TreeDrafter(model, adapter=adapter, tree_topk=tree_topk, total_tokens=total_tokens, depth=depth)
        options.append(DraftOption("draft-tree", tree, total_tokens, prior, cost * expanded, tree=True))
    core = None
    if feature_adapter is not None:
        from cats.draft.feature import FeatureDrafter, FeatureShape

        if adapter is not None:
            raise InvalidArgumentError("dytc takes an early-exit draft adapter or a feature draft adapter, not both")
        core = FeatureDrafter(model, feature_adapter, tree_topk=tree_topk, total_tokens=total_tokens, depth=depth)
        final = (feature_adapter.config.training or {}).get("final_eval") or {}
        prior = float(final.get("agreement", 0.5))
        # one adapter block and the (reduced) head per draft token: the block's share of a forward, plus the head
        cost = draft_cost(model, 1.0 / model.num_layers)
        options.append(DraftOption("eagle-chain", FeatureShape(core, 1, limit, limit), limit, prior, cost))
        options.append(DraftOption("eagle", FeatureShape(core, tree_topk, total_tokens, depth), total_tokens, prior,
                                   cost * expanded, tree=True))
    # the verification cost's shape in n, measured now (~0.8 s for SmolLM2); flat for layers streamed from disk,
    # where a forward costs about the same for any n and measuring would stream every layer 30 times
    shape = measure_shape(model) if getattr(model, "weights", None) is None else None
    return DyTCDrafter(options, lookup=lookup, lookahead_tokens=lookahead_tokens, features=core, verify_shape=shape)


def _rounded(values: list[float] | None) -> list[float] | None:
    return None if values is None else [float(f"{v:.4g}") for v in values]


def choice_shares(scheduler: dict) -> dict[str, float]:
    """Fraction of decode steps each drafter (or no draft) was chosen."""
    total = sum(scheduler["choices"].values())
    return {key: count / total for key, count in scheduler["choices"].items() if count} if total else {}


def summary_text(scheduler: dict) -> str:
    """One line for ``--stats``: the share of steps per choice and the acceptance estimates."""
    shares = ", ".join(f"{key} {share:.0%}" for key, share in choice_shares(scheduler).items())
    alphas = ", ".join(f"{key} {value:.2f}" for key, value in scheduler["estimates"]["acceptance"].items())
    pld = ", ".join(f"{n}-gram {value:.2f}" for n, value in scheduler["estimates"]["pld_acceptance"].items())
    trees = ", ".join(f"{key} {value:.2f}" for key, value in scheduler["estimates"].get("tree_yield", {}).items())
    parts = [f"chose {shares or 'nothing'}"]
    if alphas:
        parts.append(f"acceptance {alphas}")
    if pld:
        parts.append(f"pld acceptance {pld}")
    if trees:
        parts.append(f"accepted per tree {trees}")
    if scheduler["lookahead"]["steps"]:
        look = scheduler["lookahead"]
        parts.append(f"look-ahead {look['accepted']}/{look['tokens']} tokens accepted")
    return "; ".join(parts)


__all__ = ["AcceptanceEstimate", "DraftOption", "DyTCDrafter", "LatencyModel", "WindowedAverage",
           "expected_accepted"]
