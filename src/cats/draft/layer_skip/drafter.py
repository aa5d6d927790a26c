"""Layer skipping: the target with some attention and/or MLP sublayers skipped is a virtual draft model
(SWIFT, CAS-Spec's layer-sparsity DSIA). Which sublayers to skip at a given sparsity is found once per model by
`cats.draft.layer_skip.calibration` and cached.

A decoder layer is two residual sublayers: ``h + attention(norm(h))`` and ``h + mlp(norm(h))`` (Gemma3 adds a norm
after each). A skipped sublayer leaves the residual stream unchanged. Layers with nothing skipped run as the model's
own module; the others run their two parts (`split_layer`) separately.

KV-cache contract (the crux). A draft token's K/V in a layer that runs attention are computed from an
*approximate* residual stream as soon as any earlier sublayer was skipped, and a skipped attention sublayer writes
no K/V at all. None of the draft's K/V is therefore the target's, in any layer after the first skip. So:

* while drafting, the draft appends its tokens' K/V to the shared cache, in the layers whose attention it runs
  (later draft tokens attend to them, as in SWIFT), and crops them off again before `propose` returns: every layer
  then holds exactly the committed tokens, which the target wrote;
* the proposal carries no hidden states (``Proposal.hidden`` is None): the verifier runs *all* layers on
  ``[x, d_1..d_k]`` and so fills every layer, the skipped ones included, with the target's own K/V.

Handing the verifier the states after the last layer before the first skipped sublayer would save it those layers
for k+1 tokens, but costs the draft an extra pass of d_k through them: on a CPU, where a (k+1)-token forward costs
little more than a 1-token one, that is a wash, so we keep the simpler contract.

Vertical cascade (``assist``): a cheaper drafter proposes the skip model's own next tokens (prompt lookup, or a
sparser layer-skip drafter), the skip model checks them in one forward and keeps the prefix equal to its own argmax
plus its next token. The chain drafted is exactly the skip model's greedy chain; the assist only saves skip-model
forwards. A layer-skip assist uses the same cache layers: its caller parks its own draft slots
(`KVCache.split_off`) while the assist runs and restores them afterwards, and the assist first runs the caller's
drafted tokens through its own skip set (it sees them as context beyond the cache).

Trees (``tree_topk`` > 1): grown as in EAGLE-2 (`cats.draft.tree`): per depth, the ``tree_topk`` frontier nodes with
the highest cumulative draft log-probability run through the skip model at once (one forward of at most
``tree_topk`` tokens, each attending to the committed slots and its own ancestors' draft slots), and each gets its
``tree_topk`` most likely children; the ``total_tokens`` best drafted nodes are the tree verified. The cache contract
is the chain's: every draft slot is cropped before `propose` returns. A tree can pay only where a pass costs little
more with more tokens in it; on the AVX-512 kernels without AMX it did not, even under a memory budget where every
pass reads the streamed layers (docs/benchmarks.md, "`layer-skip` trees under a memory limit"), so chains are the
default.

Drafts are deterministic (the skip model's argmax, or its top-k in a tree): ``Proposal.logits`` is None, as for
prompt lookup.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from cats.draft.base import DecodeState, Drafter, Proposal
from cats.draft.prompt_lookup import PromptLookupDrafter
from cats.errors import InvalidArgumentError, UnsupportedArchitectureError
from cats.model import KVCache, LayeredModel
from cats.tree import TreeNode, add_top_children, node_attend

ATTENTION, MLP = "attention", "mlp"
NUM_TOKENS = 4  # the default draft length
TREE_DEPTH, TREE_TOKENS = 6, 16  # a tree's default depth and nodes


@dataclass(frozen=True)
class SkipSet:
    """Skipped sublayers: decoder-layer indices whose attention, and whose MLP, the draft leaves out."""

    attention: tuple[int, ...] = ()
    mlp: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "attention", tuple(sorted({int(i) for i in self.attention})))
        object.__setattr__(self, "mlp", tuple(sorted({int(i) for i in self.mlp})))

    @property
    def size(self) -> int:
        """Number of skipped sublayers."""
        return len(self.attention) + len(self.mlp)

    def sparsity(self, num_layers: int) -> float:
        """Fraction of the ``2 * num_layers`` sublayers skipped."""
        return self.size / (2 * num_layers)

    def validate(self, num_layers: int) -> None:
        for kind, layers in ((ATTENTION, self.attention), (MLP, self.mlp)):
            bad = [i for i in layers if not 0 <= i < num_layers]
            if bad:
                raise InvalidArgumentError(f"skip set names {kind} sublayers {bad} outside [0, {num_layers})")

    # sublayer j of a model: layer j // 2, attention if j is even, MLP if odd (the search works on these numbers)
    def sublayers(self) -> list[int]:
        return sorted([2 * i for i in self.attention] + [2 * i + 1 for i in self.mlp])

    @staticmethod
    def from_sublayers(sublayers: Iterable[int]) -> "SkipSet":
        sublayers = list(sublayers)
        return SkipSet(attention=tuple(j // 2 for j in sublayers if j % 2 == 0),
                       mlp=tuple(j // 2 for j in sublayers if j % 2 == 1))

    def to_dict(self) -> dict:
        return {ATTENTION: list(self.attention), MLP: list(self.mlp)}

    @staticmethod
    def from_dict(data: dict) -> "SkipSet":
        return SkipSet(attention=tuple(data.get(ATTENTION, ())), mlp=tuple(data.get(MLP, ())))


def split_layer(layer: torch.nn.Module) -> tuple[Callable, Callable]:
    """The two residual sublayers of a decoder layer: ``attention(hidden, **attention_kwargs)`` and ``mlp(hidden)``,
    each mapping the residual stream to the residual stream after it. Pre-norm layers (Llama, Mistral, Qwen2,
    Qwen3, Phi3) and Gemma3's sandwich-norm layers are supported; anything else is an
    `UnsupportedArchitectureError` (layer skipping needs to know where the residual connections are)."""
    names = {name for name, _ in layer.named_children()}
    if not {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"} <= names:
        raise UnsupportedArchitectureError(
            f"layer skipping cannot split {type(layer).__name__} into attention and MLP sublayers "
            "(expected input_layernorm, self_attn, post_attention_layernorm and mlp)")
    if layer.training:
        raise UnsupportedArchitectureError("layer skipping runs models in eval mode only (dropout would be skipped)")
    sandwich = {"pre_feedforward_layernorm", "post_feedforward_layernorm"} <= names  # Gemma3

    def attention(hidden: torch.Tensor, **kwargs) -> torch.Tensor:
        out = layer.self_attn(hidden_states=layer.input_layernorm(hidden), **kwargs)[0]
        return hidden + (layer.post_attention_layernorm(out) if sandwich else out)

    def mlp(hidden: torch.Tensor) -> torch.Tensor:
        if sandwich:
            return hidden + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    return attention, mlp


class SkipModel:
    """The target with the sublayers of ``skip`` left out, over the shared KV cache.

    Only the layers whose attention runs (``attention_layers``) read and append cache slots. Each run of consecutive
    layers that run whole goes through `LayeredModel.forward_layers` (the whole-layer kernel, one C call per run where
    it runs); a layer with one sublayer skipped runs its other one alone."""

    def __init__(self, model: LayeredModel, skip: SkipSet):
        skip.validate(model.num_layers)
        self.model, self.skip = model, skip
        skipped_attention, skipped_mlp = set(skip.attention), set(skip.mlp)
        self.attention_layers = [i for i in range(model.num_layers) if i not in skipped_attention]
        self._plan = []  # in layer order: ("whole", start, end) for layers [start, end) run whole, or ("split", i,
        # run attention?, run mlp?, parts) for a layer with a sublayer skipped (none: both skipped)
        for i, layer in enumerate(model.layers):
            if i not in skipped_attention and i not in skipped_mlp:
                if self._plan and self._plan[-1][0] == "whole" and self._plan[-1][2] == i:
                    self._plan[-1] = ("whole", self._plan[-1][1], i + 1)
                else:
                    self._plan.append(("whole", i, i + 1))
            elif i not in skipped_attention or i not in skipped_mlp:
                self._plan.append(("split", i, i not in skipped_attention, i not in skipped_mlp, split_layer(layer)))
        self._split_attention = [step[1] for step in self._plan if step[0] == "split" and step[2]]

    def forward(self, tokens: torch.Tensor, cache: KVCache, position_ids: torch.Tensor,
                attend: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the last layer, ``[1, T, H]``, for T tokens (``[T]``) at ``position_ids``.

        Every attention layer that runs must hold the same number of slots P; the T tokens are appended to each.
        ``attend`` (``[T, P + T]``) as in `LayeredModel.forward_layers`."""
        model, layers = self.model, self.attention_layers
        hidden = model.embed(tokens)
        position_ids = position_ids.to(torch.long).cpu()
        lengths = {cache.length(i) for i in layers}
        if len(lengths) > 1:
            raise RuntimeError(f"layer-skip attention layers hold different cache lengths {sorted(lengths)}")
        past_positions = cache.positions(layers[0]) if layers else torch.empty(0, dtype=torch.long)
        kinds = {model.layer_types[i] for i in self._split_attention}
        masks = {kind: model.attention_mask(past_positions, position_ids, attend, kind) for kind in kinds}
        device_positions = position_ids.to(model.device).unsqueeze(0)
        rotary = {kind: model.rotary(hidden, device_positions, kind) for kind in kinds}
        for step in self._plan:
            if step[0] == "whole":  # appends and records its layers' slots
                hidden = model.forward_layers(hidden, step[1], step[2], cache, position_ids, attend)
                continue
            _, i, run_attention, run_mlp, (attention, mlp) = step
            if run_attention:
                kind = model.layer_types[i]
                hidden = attention(hidden, attention_mask=masks[kind], position_embeddings=rotary[kind],
                                   position_ids=device_positions, cache=cache.hf_cache, use_cache=True)
            if run_mlp:
                hidden = mlp(hidden)
        for i in self._split_attention:
            cache.record(i, i + 1, position_ids)
        return hidden


class LayerSkipDrafter(Drafter):
    """Chain or tree drafts from the skip model (see the module docstring for the cache contract).

    Args:
        model: the target.
        skip: the sublayers to skip (`cats.draft.layer_skip.calibration.load_or_calibrate` finds good ones).
        num_tokens: maximum draft length k per step.
        assist: a cheaper drafter whose proposals the skip model checks (vertical cascade): a
            `PromptLookupDrafter` or a sparser `LayerSkipDrafter`; None = one skip-model forward per token.
        threshold: confidence stop: after the first drafted token, stop before a token whose draft probability
            is below this (0 = always draft ``num_tokens``); a tree stops growing where its best frontier node's
            cumulative draft probability is below it.
        sparsity: the nominal sparsity the skip set was calibrated for (shown in reports; default its own).
        agreement: the calibrated agreement with the full model (a prior for schedulers; None = unknown).
        tree_topk: 1 = a chain; more: a tree of depth ``num_tokens``, ``tree_topk`` children per expanded node and
            ``tree_topk`` nodes expanded per depth (module docstring).
        total_tokens: a tree's nodes verified (the best by cumulative draft log-probability).
    """

    name = "layer-skip"

    def __init__(self, model: LayeredModel, skip: SkipSet, num_tokens: int = NUM_TOKENS, assist: Drafter | None = None,
                 threshold: float = 0.0, sparsity: float | None = None, agreement: float | None = None,
                 tree_topk: int = 1, total_tokens: int | None = None):
        if num_tokens < 1:
            raise InvalidArgumentError(f"layer skipping needs num_tokens >= 1, got {num_tokens}")
        if tree_topk < 1 or (total_tokens is not None and total_tokens < 1):
            raise InvalidArgumentError(f"a layer-skip tree needs tree_topk and total_tokens >= 1, got {tree_topk} and "
                                       f"{total_tokens}")
        if tree_topk > 1 and assist is not None:
            raise InvalidArgumentError("a layer-skip tree drafts every node with the skip model: it takes no assist "
                                       "(an assist speeds up chains)")
        if not 0.0 <= threshold < 1.0:
            raise InvalidArgumentError(f"the draft confidence threshold must lie in [0, 1), got {threshold}")
        if assist is not None and not isinstance(assist, (PromptLookupDrafter, LayerSkipDrafter)):
            raise InvalidArgumentError("a layer-skip drafter can be assisted by prompt lookup or another layer-skip "
                                       f"drafter only, not by {type(assist).__name__}")
        self.model, self.skip_model = model, SkipModel(model, skip)
        self.skip, self.num_tokens, self.assist, self.threshold = skip, num_tokens, assist, threshold
        self.sparsity = skip.sparsity(model.num_layers) if sparsity is None else sparsity
        self.agreement = agreement
        self.tree_topk = tree_topk
        self.total_tokens = total_tokens if total_tokens is not None else num_tokens * tree_topk
        self.forwards = 0  # skip-model forwards so far (the assist saves some)

    @property
    def label(self) -> str:
        """A short name of the drafter and its assist chain, e.g. ``ls0.4<pld``."""
        own = f"ls{self.sparsity:g}"
        if isinstance(self.assist, LayerSkipDrafter):
            return f"{own}<{self.assist.label}"
        return own + ("<pld" if self.assist is not None else "")

    def propose(self, state: DecodeState, max_tokens: int) -> Proposal:
        count = min(self.num_tokens, max_tokens)
        if count <= 0:
            return Proposal.empty()
        if self.tree_topk > 1:
            return self.draft_tree(state, count)
        return Proposal(tokens=torch.tensor(self.draft(state, count), dtype=torch.long))

    def draft(self, state: DecodeState, count: int) -> list[int]:
        """The skip model's greedy chain of ``count`` tokens after ``state.token_ids``.

        The tokens of ``state.token_ids`` beyond the cache's length are run first (normally just the pending x;
        more when this drafter assists another one). Every cache layer ends as it started."""
        cache, layers = state.cache, self.skip_model.attention_layers
        base = cache.length(0)
        if any(cache.length(i) != base for i in range(self.model.num_layers)):
            raise RuntimeError(f"layer-skip drafting needs every target layer to hold the same slots, got {cache}")
        feed, position, drafted = list(state.token_ids[base:]), base, []
        try:
            while len(drafted) < count:
                remaining = count - len(drafted)
                guesses = self._assist(state, drafted, remaining - 1, base) if self.assist and remaining > 1 else []
                inputs = torch.tensor(feed + guesses, dtype=torch.long)
                hidden = self.skip_model.forward(inputs, cache, torch.arange(position, position + len(inputs)))
                self.forwards += 1
                # rows: after the last fed token, each guess (while the lm_head streams: its draft vocabulary's rows)
                logits = self.model.draft_head(hidden[0, len(feed) - 1:])
                predicted = logits.argmax(-1).tolist()
                kept = 0
                while kept < len(guesses) and guesses[kept] == predicted[kept]:
                    kept += 1
                new = predicted[: kept + 1]  # the matching guesses, then the skip model's own next token
                if self.threshold > 0:
                    confidence = torch.softmax(logits[: kept + 1].float(), -1).amax(-1).tolist()
                    stop = next((r for r, p in enumerate(confidence) if p < self.threshold and len(drafted) + r > 0),
                                None)
                    if stop is not None:
                        drafted.extend(new[:stop])
                        break
                drafted.extend(new)
                position += len(feed) + kept  # slots of the fed tokens and the kept guesses stay for the next pass
                cache.crop(position, layers)
                feed = [new[-1]]
        finally:
            cache.crop(base, layers)
        return drafted[:count]

    def draft_tree(self, state: DecodeState, depth: int) -> Proposal:
        """The skip model's tree of at most ``depth`` levels after ``state.token_ids`` (module docstring); every cache
        layer ends as it started."""
        cache, layers = state.cache, self.skip_model.attention_layers
        base, committed = cache.length(0), len(state.token_ids)
        if any(cache.length(i) != base for i in range(self.model.num_layers)):
            raise RuntimeError(f"layer-skip drafting needs every target layer to hold the same slots, got {cache}")
        nodes: list[TreeNode] = []
        try:
            feed = torch.tensor(state.token_ids[base:], dtype=torch.long)
            hidden = self.skip_model.forward(feed, cache, torch.arange(base, committed))
            self.forwards += 1
            frontier = add_top_children(nodes, self.model.draft_head(hidden[0, -1:]), [-1], 1, self.tree_topk)
            for level in range(1, depth):
                frontier = sorted(frontier, key=lambda i: (-nodes[i].score, i))[: self.tree_topk]
                if not frontier or (self.threshold and math.exp(nodes[frontier[0]].score) < self.threshold):
                    break
                past = cache.length(layers[0]) if layers else committed
                attend = node_attend(nodes, frontier, past, visible=committed)  # x is fed: slot committed - 1
                tokens = torch.tensor([nodes[i].token for i in frontier], dtype=torch.long)
                positions = torch.tensor([committed - 1 + nodes[i].depth for i in frontier])
                hidden = self.skip_model.forward(tokens, cache, positions, attend)
                self.forwards += 1
                for row, index in enumerate(frontier):
                    nodes[index].slot = past + row
                frontier = add_top_children(nodes, self.model.draft_head(hidden[0]), frontier, level + 1,
                                            self.tree_topk)
        finally:
            cache.crop(base, layers)
        # the best `total_tokens` nodes (a child never outscores its parent: the set holds every chosen node's
        # ancestors), parents before children
        chosen = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))[: self.total_tokens]
        order = sorted(chosen, key=lambda i: (nodes[i].depth, i))
        position = {index: row for row, index in enumerate(order)}
        return Proposal(tokens=torch.tensor([nodes[i].token for i in order], dtype=torch.long),
                        parents=torch.tensor([position[nodes[i].parent] if nodes[i].parent >= 0 else -1
                                               for i in order], dtype=torch.long))

    def _assist(self, state: DecodeState, drafted: list[int], limit: int, base: int) -> list[int]:
        """The assist's proposal for the tokens after ``token_ids + drafted``, at most ``limit`` long."""
        view = DecodeState(state.model, state.cache, list(state.token_ids) + drafted, state.prompt_length)
        if not isinstance(self.assist, LayerSkipDrafter):
            return self.assist.propose(view, limit).tokens.tolist()
        parked = state.cache.split_off(base, self.skip_model.attention_layers)  # our draft slots, out of its way
        try:
            return self.assist.draft(view, limit)
        finally:
            state.cache.restore(parked)

    def describe(self) -> dict:
        info = {"name": self.name, "sparsity": self.sparsity, "num_tokens": self.num_tokens,
                "skipped": self.skip.to_dict()}
        if self.agreement is not None:
            info["agreement"] = round(self.agreement, 4)
        if self.threshold:
            info["threshold"] = self.threshold
        if self.tree_topk > 1:
            info.update(tree_topk=self.tree_topk, total_tokens=self.total_tokens, depth=info.pop("num_tokens"))
        if self.assist is not None:
            info["assist"] = self.assist.describe()
        return info
