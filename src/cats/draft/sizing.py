"""How much to speculate under a memory budget.

When deep layers stream, every verification pass reads ``plan.bytes_per_pass`` from the store whatever it verifies,
so a pass should verify as many tokens as it can while its compute still hides behind that read. A few fixed
buckets (tree nodes, depth, children per node, chain length) are compared once, when the drafter is made:

* the time of a T-token pass is estimated by `streamed_pass_s`: the read time (bytes read per pass / the read
  bandwidth the streamer measured on its first reads) against the compute that cannot overlap it, from one resident
  layer and the lm_head timed on T tokens;
* the largest bucket whose pass costs at most ``NEARLY_FREE`` more than a one-token pass wins (the smallest when
  none does): beyond it a bigger tree makes every pass slower and only the acceptance it adds would pay for it;
* only buckets whose activations the memory plan reserved are candidates: the planner reserves the largest bucket
  that fits the budget without costing a resident layer (`cats.model.weights.offload.plan_for`), so a tight budget
  caps the tree.

Without a budget (or when nothing streams) the first bucket is used: the defaults of ``tree`` and ``early-exit``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class SpeculationBucket:
    total_tokens: int  # tree nodes verified per pass
    depth: int  # longest tree path
    tree_topk: int  # children per expanded node
    num_draft_tokens: int  # chain length (early-exit)

    @property
    def tree_pass_tokens(self) -> int:
        return self.total_tokens + 1

    @property
    def chain_pass_tokens(self) -> int:
        return self.num_draft_tokens + 1


def pass_tokens(bucket: "SpeculationBucket", kind: str) -> int:
    """Tokens one verification pass holds with this bucket: a chain (``chain``), a tree (``tree``), or a tree the
    cascade may extend with a correction per node (``cascade``)."""
    if kind == "chain":
        return bucket.num_draft_tokens + 1
    return (2 * bucket.total_tokens if kind == "cascade" else bucket.total_tokens) + 1


BUCKETS = (
    SpeculationBucket(total_tokens=16, depth=5, tree_topk=4, num_draft_tokens=4),
    SpeculationBucket(total_tokens=32, depth=6, tree_topk=6, num_draft_tokens=6),
    SpeculationBucket(total_tokens=64, depth=8, tree_topk=8, num_draft_tokens=8),
)
DEFAULT_BUCKET = BUCKETS[0]


NEARLY_FREE = 0.1  # a bucket's pass may cost this fraction more than a one-token pass


def choose_bucket(pass_s: Mapping[int, float], chain: bool = False,
                  buckets: tuple[SpeculationBucket, ...] = BUCKETS) -> SpeculationBucket:
    """The largest of ``buckets`` whose pass (``pass_s[tokens per pass]``) costs at most ``NEARLY_FREE`` more than a
    one-token pass (``pass_s[1]``); the smallest when none does."""
    chosen = buckets[0]
    for bucket in buckets:
        tokens = bucket.chain_pass_tokens if chain else bucket.tree_pass_tokens
        if pass_s[tokens] <= (1 + NEARLY_FREE) * pass_s[1]:
            chosen = bucket
    return chosen


def time_layer_and_head(model, tokens: int, repeats: int = 3) -> tuple[float, float]:
    """Seconds of one decoder layer and of the lm_head over ``tokens`` tokens: layer 0 (resident whenever a drafter
    runs) timed on a scratch cache of 64 tokens, the head on that many rows (a streamed head: its resident draft rows,
    scaled to the whole vocabulary); the fastest of ``repeats`` runs."""
    hidden_size = model.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    best = (float("inf"), float("inf"))
    with torch.inference_mode():
        cache = model.new_cache()
        context = torch.randn(1, 64, hidden_size, generator=generator).to(model.dtype) * 0.02
        model.forward_layers(context, 0, 1, cache)
        hidden = torch.randn(1, tokens, hidden_size, generator=generator).to(model.dtype) * 0.02
        for _ in range(repeats):
            start = time.perf_counter()
            model.forward_layers(hidden, 0, 1, cache)
            layer_s = time.perf_counter() - start
            cache.crop(64)
            start = time.perf_counter()
            if model.head_streamed:  # timed on its resident draft rows (no read), scaled to all its rows
                model.draft_head(hidden[0])
                head_s = (time.perf_counter() - start) * model.vocab_size / model.memory_plan.needs.head_draft_rows
            else:
                model.head(hidden[0])
                head_s = time.perf_counter() - start
            if layer_s * model.num_layers + head_s < best[0] * model.num_layers + best[1]:
                best = (layer_s, head_s)
    return best


def streamed_pass_s(resident: int, streamed: int, buffers: int, read_s: float, layer_s: float, head_s: float) -> float:
    """Seconds of one pass when ``streamed`` of its layers are read from disk (``read_s`` for all of them) into a
    pool of ``buffers``, the other ``resident`` layers in memory, one layer computing in ``layer_s`` and the head in
    ``head_s``. While the resident layers and the head compute, the reader can only fill the free buffers (the
    pool's layers ahead); the rest is read one layer at a time as the streamed layers compute and release theirs:

        max(S r,  (S - P) r + R c + h,  (R + S) c + h)

    (S streamed and R resident layers, P buffers, r one streamed layer's read, c ``layer_s``, h ``head_s``): the
    read alone, the reads the pool cannot take ahead after the compute that cannot overlap them, or the compute
    alone. So extra tokens are nearly free only while the resident layers' and the head's compute over them stays
    within what the pool reads ahead (measured shapes: docs/memory.md, "Speculation under a budget")."""
    if streamed <= 0:
        return (resident + streamed) * layer_s + head_s
    per_layer = read_s / streamed
    ahead = min(buffers, streamed)
    return max(read_s, (streamed - ahead) * per_layer + resident * layer_s + head_s,
               (resident + streamed) * layer_s + head_s)


def speculation_for(model, chain: bool = False) -> tuple[SpeculationBucket, dict]:
    """The bucket for ``model`` (chosen once per model and kind, then reused) and why it was chosen."""
    cache = model.__dict__.setdefault("_speculation", {})
    if chain in cache:
        return cache[chain]
    plan, weights = model.memory_plan, model.weights
    if plan is None or weights is None:
        cache[chain] = (DEFAULT_BUCKET, {"reason": "no layer streams: default speculation"})
        return cache[chain]
    # the buckets whose activations the plan reserved (all of them if it was made for another draft size)
    kind = "chain" if chain else (plan.needs.speculation if plan.needs.speculation in ("tree", "cascade") else "tree")
    if kind == "cascade" and all(pass_tokens(b, kind) > plan.needs.max_tree_tokens for b in BUCKETS):
        kind = "tree"  # planned for the bare tree: a shallow layer streams, and the cascade adds no corrections
    allowed = tuple(b for b in BUCKETS if pass_tokens(b, kind) <= plan.needs.max_tree_tokens) or BUCKETS[:1]
    bandwidth = weights.wait_for_bandwidth()
    read_s = plan.bytes_per_pass / bandwidth
    sizes = sorted({1} | {b.chain_pass_tokens if chain else b.tree_pass_tokens for b in allowed})
    pass_s = {tokens: streamed_pass_s(plan.resident_layers, plan.streamed_units, plan.pool_slots, read_s,
                                      *time_layer_and_head(model, tokens)) for tokens in sizes}
    bucket = choose_bucket(pass_s, chain, allowed)
    info = {"reason": f"largest bucket whose pass costs at most {NEARLY_FREE:.0%} more than a one-token pass",
            "buckets_planned": len(allowed), "io_s_per_pass": round(read_s, 4),
            "read_mb_per_s": round(bandwidth / 2**20, 1), "pass_s": {str(k): round(v, 4) for k, v in pass_s.items()},
            "bucket": asdict(bucket)}
    cache[chain] = (bucket, info)
    return cache[chain]
