"""DyTC's online estimators: per-token acceptance (a windowed, exponentially weighted average with a prior), the
expected accepted tokens of a chain under it, the prompt-lookup match classes the estimates are kept per, and the
drafting-time lines ``a + b * k`` fitted by recursive least squares (`cats.draft.dytc.scheduler` uses them)."""

from __future__ import annotations

from collections import deque

import numpy as np

from cats.draft.dytc.cost import rls_step
from cats.draft.prompt_lookup import LookupMatch

DECAY, WINDOW = 0.7, 20  # CAS-Spec's acceptance moving average
FORGETTING = 0.98  # latency fits
LONG_DECAY = 0.99  # per step: a drafter's long-run acceptance (`AcceptanceEstimate`)
# prompt-lookup acceptance before any observation, by matched n-gram length. Optimistic on purpose: a prior under
# which prompt lookup never beats plain decoding is never measured (1-gram matches at 0.3 were never tried on
# Spec-Bench, while their measured rate, where used, was ~0.5)
PLD_PRIORS = {1: 0.5, 2: 0.6, 3: 0.7, 4: 0.75, 8: 0.9}
MATCH_CLASSES = tuple(PLD_PRIORS)  # a match is classed by how far back it holds: 1, 2, 3, 4-7 or 8+ tokens
MAX_ALPHA = 0.98


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
    """Per-token acceptance alpha of one drafter, on two time scales. Each step it drafted adds its accepted tokens
    over its trials (accepted + 1 if a drafted token was rejected).

    * Recent: the steps of the last ``window`` steps, weighted ``decay ** age`` by their age in *steps* (CAS-Spec's
      moving average where the drafter drafts every step);
    * long-run: every step it drafted, weighted ``LONG_DECAY ** age``, with the prior as one trial.

    The estimate is the recent ratio with the long-run rate as one more trial. While the drafter drafts, the recent
    steps decide; when a run of rejections benches it, its recent steps fade with every step it is not chosen and the
    estimate returns to what it usually accepts, so it is tried again within a few steps rather than after the
    whole window. A drafter that usually fails stays benched: its long-run rate is low. (On a simulated target where
    a drafter accepting half its tokens always pays, CAS-Spec's average alone benched it on 22-44 % of the steps, this
    one on none: `tests/test_dytc.py`.)"""

    def __init__(self, prior: float, decay: float = DECAY, window: int = WINDOW):
        super().__init__(prior, decay, window)  # its history: (step, accepted, trials)
        self.long_accepted = self.long_trials = 0.0  # weighted as of step `long_step`
        self.long_step = 0

    def _age_long(self, step: int) -> None:
        if step > self.long_step:
            factor = LONG_DECAY ** (step - self.long_step)
            self.long_accepted, self.long_trials, self.long_step = (self.long_accepted * factor,
                                                                    self.long_trials * factor, step)

    def observe_step(self, step: int, accepted: int, drafted: int) -> None:
        if drafted <= 0:
            return
        trials = float(accepted + (1 if accepted < drafted else 0))
        self.observe(step, float(accepted), trials)
        self._age_long(step)
        self.long_accepted += accepted
        self.long_trials += trials

    def long_run(self, step: int) -> float:
        """The long-run rate: every observation weighted by its age, the prior as one trial."""
        self._age_long(step)
        return (self.long_accepted + self.prior) / (self.long_trials + 1.0)

    def value(self, step: int) -> float:
        numerator, denominator = self.long_run(step), 1.0
        for observed, accepted, trials in self._recent(step):
            weight = self.decay ** (step - observed)
            numerator += weight * accepted
            denominator += weight * trials
        return min(numerator / denominator, MAX_ALPHA)


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


__all__ = ["DECAY", "FORGETTING", "LONG_DECAY", "MATCH_CLASSES", "MAX_ALPHA", "PLD_PRIORS", "WINDOW", "AcceptanceEstimate",
           "LatencyModel", "WindowedAverage", "expected_accepted", "match_class"]
