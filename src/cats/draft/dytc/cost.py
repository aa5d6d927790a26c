"""What verifying n tokens costs: a target forward over n tokens after T cached ones, measured once, tracked online.

DyTC divides expected tokens by predicted seconds, so the prediction must hold for every token count it might
choose, including those it rarely chooses. A cost curve fitted only online traps itself: a pessimistic estimate for
a size seldom verified (one slow step is enough) is never corrected, because that size is then never chosen. On 48
Spec-Bench questions the online fit ended at 102 ms for 16 tokens, where 16 tokens cost ~40 ms, and DyTC cut prompt
lookup's chains to 7 tokens in long copies that `pld` verified 10 at a time.

So the curve's *shape* in n is measured up front (`measure_shape`, once per model in memory, `measured_shape`:
SmolLM2-135M bf16 takes ~0.8 s, Qwen2.5-Coder-1.5B Q4_K_M 3.4 s): a forward plus the head over n = 1..32 tokens
after a short context, the fastest of two runs per size.
Online, `VerifyCost` fits by recursive least squares with forgetting only what the shape cannot know:

    seconds(n, T) = s1 * (a * shape(n) + b + c * n * dT + d * dT),    dT = (T - T0) / 1000

(``s1``: the measured one-token time, ``T0``: the context it was measured at): ``a`` and ``b`` follow the machine's
speed and the decode loop's overhead, ``c`` and ``d`` the attention over a longer context (measured on SmolLM2 bf16:
about 1 ms per query token and 4 ms per forward per 1000 cached tokens). Every step informs all four, whatever n it
verified, so no size keeps a stale estimate. An observation is clipped to [2/3, 3/2] times the prediction before the
update: one step descheduled by the OS must not move the curve. Predictions from a measured shape take the fit only
as far as it can be true: ``c, d`` at least 0 (attention never gets cheaper with more context), ``a`` at least
`MIN_SCALE`. Taken as fitted, large trees verified cheaply at one long context (noise, or a machine that sped up)
turned ``c`` negative, and the extrapolation to a longer one predicted 32 tokens for a one-token forward's time: in
a Spec-Bench run on Qwen2.5-Coder-1.5B the curve at an 800-token context read 5.8 ms for every n, and DyTC drafted
435 tokens in 27 steps for 69 accepted (5.8 tok/s against `ar`'s 8.1). Predictions are non-decreasing in n.

A model that streams its deep layers under a memory budget gets `streamed_shape` (`cats.draft.sizing.streamed_pass_s`):
the reader fills the next layers while the current ones compute, but only as many as its buffers hold while the
resident layers and the head compute, so extra tokens are nearly free only while that compute stays within the
reads the buffers take ahead, and DyTC verifies larger trees where it does. Without any shape (tests), the
shape is flat: optimistic for more tokens, and the fit's scale comes from the first observation.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cats.draft.sizing import streamed_pass_s, time_layer_and_head

CALIBRATION_SIZES = (1, 2, 4, 6, 8, 10, 12, 16, 32)  # token counts measured (linear in between, and beyond)
CALIBRATION_CONTEXT = 64  # cached tokens (random) when measuring
CALIBRATION_REPEATS = 2  # runs per size: the fastest counts (timing noise on a CPU only ever adds)
CLIP = 1.5  # an observation counts as at most CLIP times, and at least 1 / CLIP times, the prediction
MIN_SCALE = 0.5  # the fit's factor on the measured shape (a) stays at least this: the machine at most twice as fast


@dataclass(frozen=True)
class CostShape:
    """Measured seconds of a forward plus head over ``tokens[i]`` tokens after ``context`` cached ones."""

    tokens: tuple[int, ...]  # ascending, starting at 1
    seconds: tuple[float, ...]  # non-decreasing
    context: int = 0
    measure_s: float = 0.0  # wall time the measurement took

    def __post_init__(self):
        if not self.tokens or self.tokens[0] != 1 or list(self.tokens) != sorted(set(self.tokens)):
            raise ValueError(f"a cost shape needs ascending distinct token counts from 1, got {self.tokens}")
        if len(self.seconds) != len(self.tokens) or min(self.seconds) <= 0:
            raise ValueError("a cost shape needs one positive time per token count")

    @classmethod
    def flat(cls) -> "CostShape":
        return cls((1,), (1.0,))

    @classmethod
    def of(cls, seconds: dict[int, float], context: int = 0, measure_s: float = 0.0) -> "CostShape":
        """From measured times per token count: made non-decreasing from the right (a size that measured slower
        than a larger one takes the larger one's time: noise only ever adds)."""
        tokens = sorted(seconds)
        values = np.minimum.accumulate(np.array([seconds[n] for n in tokens], dtype=float)[::-1])[::-1]
        return cls(tuple(int(n) for n in tokens), tuple(float(v) for v in values), context, measure_s)

    @property
    def single(self) -> float:
        return self.seconds[0]

    def relative(self, n: np.ndarray) -> np.ndarray:
        """Time of n tokens in units of one token's: linear between measured sizes, beyond the largest at the slope
        of the last two (flat if only one was measured)."""
        n = np.asarray(n, dtype=float)
        tokens, seconds = np.asarray(self.tokens, dtype=float), np.asarray(self.seconds) / self.single
        inside = np.interp(n, tokens, seconds)
        if len(tokens) < 2:
            return inside
        slope = (seconds[-1] - seconds[-2]) / (tokens[-1] - tokens[-2])
        return np.where(n > tokens[-1], seconds[-1] + slope * (n - tokens[-1]), inside)

    def to_dict(self) -> dict:
        return {"context": self.context, "measure_s": round(self.measure_s, 3),
                "by_tokens": {str(n): round(s, 5) for n, s in zip(self.tokens, self.seconds)}}


def streamed_shape(model, sizes: Sequence[int] = CALIBRATION_SIZES, repeats: int = CALIBRATION_REPEATS,
                   clock: Callable[[], float] = time.perf_counter) -> CostShape:
    """The cost of a pass over ``sizes`` tokens for a model whose deep layers stream (`streamed_pass_s`): the read
    time from the plan's bytes per pass and the reader's measured bandwidth, one layer's compute from layer 0 timed on
    n tokens, and the head's (`cats.draft.sizing.time_layer_and_head`: no streamed layer is read for them)."""
    began = clock()
    plan = model.memory_plan
    read_s = plan.bytes_per_pass / model.weights.wait_for_bandwidth()
    streamed = plan.streamed_units  # the streamed layers and the streamed lm_head's pieces
    seconds = {n: streamed_pass_s(plan.resident_layers, streamed, plan.pool_slots, read_s,
                                  *time_layer_and_head(model, n, repeats=repeats)) for n in sizes}
    return CostShape.of(seconds, context=64, measure_s=clock() - began)


@torch.inference_mode()
def measure_shape(model, sizes: Sequence[int] = CALIBRATION_SIZES, context: int = CALIBRATION_CONTEXT,
                  repeats: int = CALIBRATION_REPEATS, seed: int = 0,
                  clock: Callable[[], float] = time.perf_counter) -> CostShape:
    """Time the target's forward plus head over each of ``sizes`` tokens after ``context`` cached random tokens, in
    a cache of its own (a few MB), sizes interleaved over ``repeats`` rounds, after an untimed warm-up forward."""
    began = clock()
    generator = torch.Generator().manual_seed(seed)
    low = min(100, model.vocab_size - 1)

    def tokens(count: int) -> torch.Tensor:
        return torch.randint(low, model.vocab_size, (count,), generator=generator)

    cache = model.new_cache(capacity=context + max(sizes))
    model.forward_layers(model.embed(tokens(context)), 0, model.num_layers, cache)
    model.head(model.forward_layers(model.embed(tokens(max(sizes))), 0, model.num_layers, cache)[0])
    cache.crop(context)
    best: dict[int, float] = {}
    for _ in range(repeats):
        for n in sizes:
            hidden = model.embed(tokens(n))
            start = clock()
            _wait(model.head(model.forward_layers(hidden, 0, model.num_layers, cache)[0]))
            best[n] = min(clock() - start, best.get(n, float("inf")))
            cache.crop(context)
    return CostShape.of(best, context, clock() - began)


_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model.hf_model -> {(threads, kernel path):
# CostShape} (the model itself is not hashable; its entry goes with its weights)


def measured_shape(model) -> CostShape:
    """`measure_shape` once per model and setting that changes a forward's time (threads, kernel path): each DyTC
    drafter made for the same model in memory reuses it (Qwen2.5-Coder-1.5B Q4_K_M: 3.4 s a measurement on 2 cores,
    which every `generate` call with ``method="dytc"`` paid)."""
    key = (torch.get_num_threads(), getattr(model, "kernel_path", None))
    shapes = _MEASURED.setdefault(model.hf_model, {})
    if key not in shapes:
        shapes[key] = measure_shape(model)
    return shapes[key]


def _wait(result: torch.Tensor) -> None:
    """Block until ``result`` is computed (an accelerator runs kernels asynchronously; a CPU already has)."""
    if result.device.type == "cuda":
        torch.cuda.synchronize(result.device)


def rls_step(theta: np.ndarray, P: np.ndarray, P0: np.ndarray, phi: np.ndarray, y: float,
             forgetting: float) -> tuple[np.ndarray, np.ndarray]:
    """One recursive-least-squares update with forgetting of ``y ~ phi @ theta``; the covariance is capped at 1000x
    the prior's trace, so that directions the data do not excite cannot wind up."""
    gain = P @ phi / (forgetting + phi @ P @ phi)
    theta = theta + gain * (y - phi @ theta)
    P = (P - np.outer(gain, phi @ P)) / forgetting
    limit = 1e3 * np.trace(P0)
    if np.trace(P) > limit:
        P = P * (limit / np.trace(P))
    return theta, P


class VerifyCost:
    """Seconds of one target forward over n tokens with T tokens in the cache (module docstring): the measured
    ``shape`` scaled and shifted online, plus an attention term in the context."""

    PRIOR = (1.0, 0.0, 0.0, 0.0)

    def __init__(self, forgetting: float = 0.98, shape: CostShape | None = None):
        self.forgetting = forgetting
        self.shape = shape
        self._shape = shape or CostShape.flat()
        self.scale: float | None = shape.single if shape is not None else None
        self.theta = np.array(self.PRIOR)
        self.P0 = np.diag([0.1, 0.01, 0.01, 0.1])
        self.P = self.P0.copy()
        self.count = 0

    def _rows(self, n: np.ndarray, context: int) -> np.ndarray:
        n = np.asarray(n, dtype=float)
        delta = (context - self._shape.context) / 1000.0
        return np.stack([self._shape.relative(n), np.ones_like(n), n * delta, np.full_like(n, delta)], axis=-1)

    @property
    def ready(self) -> bool:
        return self.scale is not None

    def observe(self, n: int, context: int, seconds: float) -> None:
        if self.scale is None:
            self.scale = max(seconds, 1e-9)
        phi = self._rows(np.array(float(n)), context)
        predicted = max(float(phi @ self._predicting()), 1e-6)
        target = min(max(seconds / self.scale, predicted / CLIP), predicted * CLIP)
        self.theta, self.P = rls_step(self.theta, self.P, self.P0, phi, target, self.forgetting)
        self.count += 1

    def _predicting(self) -> np.ndarray:
        """The fit as predictions use it: with a measured shape, what can be true (module docstring: ``c, d >= 0``,
        ``a >= MIN_SCALE``); without one (the flat shape) the terms mean nothing physical (``a`` stands in for ``b``,
        ``c`` for the slope in n) and are taken as fitted."""
        if self.shape is None:
            return self.theta
        a, b, c, d = self.theta
        return np.array([max(a, MIN_SCALE), b, max(c, 0.0), max(d, 0.0)])

    def curve(self, context: int, max_n: int) -> np.ndarray:
        """Predicted seconds for n = 0..max_n (entry 0 unused), non-decreasing in n, at least a microsecond."""
        if self.scale is None:
            return np.ones(max_n + 1)
        n = np.arange(1, max_n + 1, dtype=float)
        seconds = np.maximum.accumulate(np.maximum(self._rows(n, context) @ self._predicting() * self.scale, 1e-6))
        return np.concatenate([[seconds[0]], seconds])

    def predict(self, n: int, context: int) -> float:
        return float(self.curve(context, n)[n])

    def coefficients(self) -> list[float] | None:
        return None if self.scale is None else [float(c * self.scale) for c in self.theta]


__all__ = ["CALIBRATION_SIZES", "CostShape", "VerifyCost", "measure_shape", "measured_shape", "rls_step"]
