"""Making the DyTC scheduler of method ``dytc``: its drafters (prompt lookup, token recycling, layer skipping and
a trained draft adapter), their priors of acceptance and cost, and the measured shape of the verification cost."""

from __future__ import annotations

from collections.abc import Sequence

from cats.draft.dytc.cost import measured_shape, streamed_shape
from cats.draft.dytc.hindsight import TREE_SIZES
from cats.draft.dytc.scheduler import DraftOption, DyTCDrafter
from cats.draft.eagle import FeatureDrafter, FeatureDrafterView
from cats.draft.early_exit import EarlyExitDrafter
from cats.draft.layer_skip.calibration import load_or_calibrate
from cats.draft.layer_skip.drafter import LayerSkipDrafter
from cats.draft.prompt_lookup import PromptLookupDrafter
from cats.draft.recycle import TokenRecyclingDrafter
from cats.draft.tree import TreeDrafter
from cats.errors import InvalidArgumentError

PLD_COST = 0.002  # a near-free draft's nominal cost per token, as a fraction of a one-token forward (token recycling's
# option; the scheduler treats both near-free drafts as drafted anyway and charges them nothing)
LOOKUP_TOKENS = 16  # prompt lookup's continuation, drafted every step; the hindsight records tell how much of it pays
# (replaying records of 128 Spec-Bench questions outside the evaluation set: 16 tokens gave 1.13x `pld`'s mean speed
# where 10, `pld`'s own length, gave 1.06x: loops and long copies go on past 10 tokens)
RECYCLE_TOKENS = max(TREE_SIZES)  # token recycling's template in DyTC; each step verifies the cut that pays
MODEL_TOKENS = 8  # a model drafter's longest chain (``num_tokens``' default)
RECYCLE_PRIOR = 0.5  # its per-token prior along the best path (optimistic, as for prompt lookup: measurement decides)


def draft_cost(model, layer_fraction: float) -> float:
    """Prior cost of one draft token as a fraction of a one-token target forward: the draft runs
    ``layer_fraction`` of the decoder's weights and the whole lm_head (the bytes of weights read per token dominate
    on CPUs)."""
    layers = sum(p.numel() * p.element_size() for p in model.layers.parameters())
    head = sum(p.numel() * p.element_size() for p in model.hf_model.lm_head.parameters())
    return (layer_fraction * layers + head) / (layers + head)


def pass_sizes(num_tokens: int | None = None) -> tuple[int, ...]:
    """The verification passes (tokens, x included) an adapter-free DyTC is planned for under a memory budget,
    smallest first: a model drafter's longest chain, the whole recycling tree, and that tree with the whole lookup
    chain grafted in. The plan reserves the largest whose activations cost no resident layer
    (`cats.model.weights.offload.plan_for`), and the scheduler drafts within it (``max_pass_tokens``)."""
    chain = (num_tokens or MODEL_TOKENS) + 1
    return tuple(sorted({chain, max(chain, RECYCLE_TOKENS + 1), max(chain, LOOKUP_TOKENS + RECYCLE_TOKENS + 1)}))


def make_dytc(model, sparsities: Sequence[float] = (0.4, 0.6), adapter=None, max_ngram: int = 3,
              num_tokens: int | None = None, lookahead_tokens: int = 4, tree_topk: int = 4, total_tokens: int = 16,
              depth: int = 5, feature_adapter=None, recycle: bool = True, streamed_skip=None,
              max_pass_tokens: int | None = None, progress: bool = True) -> DyTCDrafter:
    """The training-free hierarchy of CAS-Spec plus, optionally, a trained draft adapter:

    * prompt lookup (up to `LOOKUP_TOKENS` tokens, the scheduler picks how many to verify), also the bottom
      look-ahead;
    * token recycling (``recycle``, `cats.draft.recycle`): trees read off the table of the target's own recent
      candidates along a template of ``RECYCLE_TOKENS`` nodes, near-free like prompt lookup (its table learns from
      every verification, whichever option drafted); each step verifies the cut of tree and lookup chain that
      pays (`cats.draft.dytc.scheduler`);
    * for each sparsity s, a layer-skip drafter ``ls<s><pld`` whose own tokens prompt lookup proposes (vertical
      cascade); with two or more sparsities also ``ls<lowest><ls<highest><pld``, the densest drafter assisted by
      the sparsest;
    * with ``streamed_skip`` (under a memory budget: the skip set of the streamed layers and its calibrated agreement,
      `cats.draft.layer_skip.stream_order.streamed_skip`), a layer-skip drafter over the resident layers alone, whose
      own tokens prompt lookup proposes: its draft tokens read nothing from disk;
    * with ``adapter``, the early exit through it: chains (``draft-adapter``) and dynamic trees of
      ``total_tokens`` nodes (``draft-tree``, shaped by ``tree_topk`` and ``depth`` as in method ``tree``);
    * or, with ``feature_adapter``, feature drafting (method ``eagle``): chains (``eagle-chain``) and trees
      (``eagle``), one drafter behind both.

    Model drafters draft up to ``num_tokens`` (default 8) tokens; no pass holds more than ``max_pass_tokens`` (under a
    budget: the pass the plan reserved). Priors: a layer-skip drafter's calibrated
    agreement, the adapter's held-out agreement (0.6 if unknown); costs from the share of the weights a draft token
    runs through (`draft_cost`)."""
    limit = num_tokens or MODEL_TOKENS
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
    if streamed_skip is not None:
        skip, agreement = streamed_skip
        sparsity = skip.sparsity(model.num_layers)
        drafter = LayerSkipDrafter(model, skip, num_tokens=limit, assist=bottom, sparsity=sparsity,
                                   agreement=agreement)
        options.append(DraftOption(drafter.label, drafter, limit, agreement, draft_cost(model, 1.0 - sparsity)))
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
        if adapter is not None:
            raise InvalidArgumentError("dytc takes an early-exit draft adapter or a feature draft adapter, not both")
        core = FeatureDrafter(model, feature_adapter, tree_topk=tree_topk, total_tokens=total_tokens, depth=depth)
        final = (feature_adapter.config.training or {}).get("final_eval") or {}
        prior = float(final.get("agreement", 0.5))
        # one adapter block and the (reduced) head per draft token: the block's share of a forward, plus the head
        cost = draft_cost(model, 1.0 / model.num_layers)
        options.append(DraftOption(f"{core.name}-chain", FeatureDrafterView(core, 1, limit, limit), limit, prior, cost))
        options.append(DraftOption(core.name, FeatureDrafterView(core, tree_topk, total_tokens, depth), total_tokens,
                                   prior, cost * expanded, tree=True))
    # the verification cost's shape in n, measured once per model in memory (~0.8 s for SmolLM2); for layers streamed
    # from disk, the read time or the compute, whichever is longer (measuring whole forwards would stream every layer
    # 30 times)
    shape = measured_shape(model) if getattr(model, "weights", None) is None else streamed_shape(model)
    return DyTCDrafter(options, lookup=lookup, lookahead_tokens=lookahead_tokens, features=core, verify_shape=shape,
                       max_pass_tokens=max_pass_tokens)


__all__ = ["LOOKUP_TOKENS", "MODEL_TOKENS", "PLD_COST", "RECYCLE_PRIOR", "RECYCLE_TOKENS", "draft_cost", "make_dytc",
           "pass_sizes"]
