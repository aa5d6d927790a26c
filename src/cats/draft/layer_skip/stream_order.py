"""Calibrating a model's stream order (`cats.model.weights.stream_order`): whole decoder layers, in the order a memory
budget streams them, chosen so that a layer-skip draft skipping the streamed ones agrees with the full model best.

The objective is `calibration.AgreementProbe`'s (the skip model's argmax against the full model's greedy tokens,
teacher-forced). The search is greedy and nested, so that every prefix is a skip set:

1. scan: the agreement with each layer skipped alone (layers ``[first, L)``; layer 0 and the layers below ``first``
   never stream first: `cats.method_needs` keeps layer 0 resident for DyTC's cost model, and it is the one a draft
   can least do without);
2. then, ``length`` times, the layer whose skipping together with those already chosen keeps the agreement
   highest joins the order; the candidates of a step are the ``width`` layers that hurt least alone and are not
   chosen yet.

On Qwen2.5-Coder-1.5B (28 layers), the best whole-layer skip sets found by a local search agreed 0.71, 0.65 and
0.55 with 12, 14 and 16 layers skipped, where skipping the deepest 14 (an early exit without an adapter) agreed
0.08: which layers stream decides whether the resident ones can draft at all.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from tqdm import tqdm

from cats.draft.layer_skip.calibration import AgreementProbe, calibration_prompts, prompts_digest
from cats.draft.layer_skip.drafter import SkipSet
from cats.errors import InvalidArgumentError
from cats.model import LayeredModel
from cats.model.identity import model_identity
from cats.model.weights.stream_order import StreamOrder, store_stream_order

WIDTH = 8  # candidates tried per step


def skip_layers(layers: Sequence[int]) -> SkipSet:
    """The skip set of whole layers: their attention and their MLP."""
    return SkipSet(attention=tuple(layers), mlp=tuple(layers))


def calibrate_stream_order(model: LayeredModel, length: int | None = None, prompts=None,
                           prompt_source=None, tokens: int = 32, num_prompts: int = 8, width: int = WIDTH,
                           first: int = 1, progress: bool = False, save: bool = True) -> StreamOrder:
    """The stream order of ``model`` (module docs), ``length`` layers long (default: every layer from ``first`` on, so
    that it covers any budget), cached unless ``save`` is False. ``prompts``: token-id prompts, else
    `calibration_prompts` from ``prompt_source``."""
    num_layers = model.num_layers
    length = num_layers - first if length is None else length
    if not 1 <= first < num_layers or not 1 <= length <= num_layers - first:
        raise InvalidArgumentError(f"a stream order of {length} layers from layer {first} does not fit "
                                   f"{num_layers} layers")
    if width < 1:
        raise InvalidArgumentError(f"the stream order search needs a width of at least 1, got {width}")
    source = "token ids"
    if prompts is None:
        prompts, source = calibration_prompts(model, prompt_source, num_prompts)
    start = time.perf_counter()
    candidates = range(first, num_layers)
    with tqdm(total=len(candidates) + length * width, unit="set", disable=not progress, file=sys.stderr,
              desc="stream order: continuations") as bar:
        probe = AgreementProbe(model, prompts, tokens)
        bar.set_description("stream order: scan")
        alone = {}
        for layer in candidates:
            alone[layer] = probe.agreement(skip_layers([layer]))
            bar.update()
        ranked = sorted(candidates, key=lambda i: (-alone[i], -i))  # least harmful first; ties: deeper first
        order, agreement = [], []
        for step in range(length):
            bar.set_description(f"stream order: {step + 1} of {length} layers")
            trials = [layer for layer in ranked if layer not in order][:width]
            scores = {}
            for layer in trials:
                scores[layer] = probe.agreement(skip_layers(order + [layer]))
                bar.update()
            best = max(trials, key=lambda i: (scores[i], -ranked.index(i)))
            order.append(best)
            agreement.append(scores[best])
    settings = {"tokens": tokens, "width": width, "first": first, "prompts": source,
                "prompts_sha256": prompts_digest(prompts), "evaluations": probe.evaluations,
                "seconds": round(time.perf_counter() - start, 1)}
    result = StreamOrder(tuple(order), tuple(round(a, 6) for a in agreement), settings)  # as the file keeps them
    if save:
        store_stream_order(model_identity(model), result)
    return result


def streamed_skip(model: LayeredModel) -> tuple[SkipSet, float] | None:
    """Under a memory plan that streams a prefix of the model's calibrated stream order (as the plan holds it:
    ``needs.stream_order`` and ``needs.stream_agreement``): the skip set of the streamed layers and the agreement
    calibrated for it; else None (nothing streams, the deepest layers do, or more stream than the order lists)."""
    plan = model.memory_plan
    if model.weights is None or plan is None:
        return None
    count = len(plan.streamed)
    if not 0 < count <= len(plan.needs.stream_agreement):
        return None
    return skip_layers(plan.streamed), plan.needs.stream_agreement[count - 1]


__all__ = ["WIDTH", "calibrate_stream_order", "skip_layers", "streamed_skip"]
