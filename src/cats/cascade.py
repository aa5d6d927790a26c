"""The cascade: a shallow verifier between the draft and the full target (the "C" in CATS).

For a drafted tree (or chain) over ``[x, n_0 .. n_{k-1}]`` whose states after layer L_d the drafter left behind:

1. layers ``[L_d, L_sv)`` run on all nodes (tree mask), reusing the draft's K/V for ``[0, L_d)``;
2. the shallow adapter at L_sv gives its own next-token distribution after x and after every node;
3. (a) a node whose token the shallow verifier gives probability below ``sv_threshold`` is pruned with its subtree;
   (b) where the shallow verifier's top token after x or after an expanded node is none of the drafted children,
   it is added as a correction branch (run once through ``[0, L_sv)``, and the draft adapter, to join the tree);
4. the cache layers ``[0, L_sv)`` (and the adapters') keep only the surviving nodes, and the deep layers
   ``[L_sv, N)`` run on the surviving tree only.

No layer runs twice for the same node, and the full target still decides every token, so greedy output is
unchanged (lossless); the cascade only decides which nodes the deep layers spend their time on.

Counters per generation (`ShallowCounts`): for every drafted node whose parent the target verified, the shallow
decision (keep / prune) against the target's (the node's token is the target's choice at its parent): TP = kept
and right, FP = kept and wrong, TN = pruned and wrong, FN = pruned and right; nodes whose parent was pruned too have
no target decision and are counted as ``undecided``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from cats.draft.adapter import Adapter
from cats.draft.base import DecodeState, Proposal
from cats.draft.early_exit import EarlyExitDrafter
from cats.errors import InvalidArgumentError
from cats.model import LayeredModel
from cats.tree import chain_parents, verification_inputs


@dataclass
class ShallowCounts:
    true_positive: int = 0
    false_positive: int = 0
    true_negative: int = 0
    false_negative: int = 0
    undecided: int = 0  # pruned nodes below a pruned parent: the target never saw their parent
    nodes_drafted: int = 0
    nodes_pruned: int = 0
    nodes_corrected: int = 0  # correction branches added by the shallow verifier
    nodes_verified: int = 0  # nodes the deep layers ran on
    steps: int = 0
    shallow_s: float = 0.0
    deep_s: float = 0.0

    @property
    def precision(self) -> float:
        kept = self.true_positive + self.false_positive
        return self.true_positive / kept if kept else 0.0

    @property
    def recall(self) -> float:
        right = self.true_positive + self.false_negative
        return self.true_positive / right if right else 0.0

    @property
    def f1(self) -> float:
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r) if p + r else 0.0

    @property
    def keep_rate(self) -> float:
        """The shallow verifier's acceptance rate: drafted nodes it let through to the deep layers."""
        return 1 - self.nodes_pruned / self.nodes_drafted if self.nodes_drafted else 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(precision=round(self.precision, 4), recall=round(self.recall, 4), f1=round(self.f1, 4),
                    keep_rate=round(self.keep_rate, 4))
        return data


class CascadeScorer:
    """Shallow-verifier cascade in front of the full target (see the module docstring).

    Args:
        model: the target.
        shallow: the shallow adapter (role ``shallow``) at layer L_sv.
        drafter: the early-exit or tree drafter whose proposals it checks (its adapter joins correction nodes);
            None when proposals come without hidden states (prompt lookup).
        sv_threshold: prune a node whose token the shallow verifier gives a probability below this (0: never).
        corrections: add the shallow verifier's own top token as a branch where it disagrees with the draft.
    """

    name = "cascade"
    cache_layers = 1

    def __init__(self, model: LayeredModel, shallow: Adapter, drafter: EarlyExitDrafter | None = None,
                 sv_threshold: float = 0.05, corrections: bool = True):
        self.model, self.shallow, self.drafter = model, shallow, drafter
        self.layer = shallow.config.layer
        if drafter is not None and drafter.layer >= self.layer:
            raise InvalidArgumentError(f"the shallow verifier's layer ({self.layer}) must lie above the draft layer "
                                       f"({drafter.layer})")
        if not 0.0 <= sv_threshold < 1.0:
            raise InvalidArgumentError(f"--sv-threshold must lie in [0, 1), got {sv_threshold}")
        self.sv_threshold, self.corrections = sv_threshold, corrections
        self.prefill_layers = (self.layer,)
        shallow.cache_layer = model.num_layers + (drafter.cache_layers if drafter is not None else 0)
        self.counts = ShallowCounts()

    def prefill(self, state: DecodeState, hidden: dict[int, torch.Tensor]) -> None:
        self.counts = ShallowCounts()
        self.shallow(hidden[self.layer], state.cache)

    def counters(self) -> dict:
        return self.counts.to_dict()

    def describe(self) -> dict:
        return {"name": self.name, "layer": self.layer, "sv_threshold": self.sv_threshold, "corrections": self.corrections}

    # ------------------------------------------------------------------------------------------------ the cascade
    def score(self, state: DecodeState, proposal: Proposal) -> tuple[Proposal, torch.Tensor]:
        model, cache, committed = self.model, state.cache, state.committed_length
        tick = time.perf_counter()
        count = proposal.num_tokens
        parents = proposal.parents if proposal.parents is not None else chain_parents(count)
        tokens = proposal.tokens
        positions, attend = verification_inputs(parents, committed)
        # 1. up to L_sv, reusing what the drafter computed
        if proposal.hidden is not None:
            hidden, start = proposal.hidden, proposal.hidden_layer
        else:
            hidden, start = model.embed(torch.cat([torch.tensor([state.token_ids[-1]]), tokens])), 0
        hidden = model.forward_layers(hidden, start, self.layer, cache, position_ids=positions, attend=attend)
        # 2. the shallow verifier's distribution after x and after every node: [k+1, V]
        shallow_probs = torch.softmax(self.shallow.full_logits(self.shallow(hidden, cache, positions, attend=attend)[0]).float(), -1)
        shallow_choice = shallow_probs.argmax(-1)
        # 3a. prune nodes the shallow verifier finds unlikely, with their subtrees
        pruned = [False] * count
        for node in range(count):
            parent = int(parents[node])
            unlikely = float(shallow_probs[parent + 1, tokens[node]]) < self.sv_threshold
            pruned[node] = unlikely or (parent >= 0 and pruned[parent])
        survivors = [node for node in range(count) if not pruned[node]]
        # 3b. corrections: the shallow verifier's top token where no drafted child carries it
        corrections: list[tuple[int, int]] = []  # (parent node or -1, token)
        if self.corrections:
            children: dict[int, set[int]] = {}
            for node in range(count):
                children.setdefault(int(parents[node]), set()).add(int(tokens[node]))
            for parent in [-1] + survivors:
                if parent in children and int(shallow_choice[parent + 1]) not in children[parent]:
                    corrections.append((parent, int(shallow_choice[parent + 1])))
        # 4. keep the survivors in the shallow layers, add the corrections, then the deep layers on the new tree
        new_index = {-1: -1, **{node: i for i, node in enumerate(survivors)}}
        shallow_layers = list(range(self.layer)) + [self.shallow.cache_layer]
        if self.drafter is not None and self.drafter.adapter is not None:
            shallow_layers.append(self.drafter.adapter.cache_layer)
        if len(survivors) < count:
            cache.keep(torch.cat([torch.arange(committed + 1), committed + 1 + torch.tensor(survivors, dtype=torch.long)]),
                       layers=shallow_layers)
        new_tokens = [int(tokens[node]) for node in survivors] + [token for _, token in corrections]
        new_parents = torch.tensor([new_index[int(parents[node])] for node in survivors]
                                   + [new_index[parent] for parent, _ in corrections], dtype=torch.long)
        states = [hidden[:, [0] + [node + 1 for node in survivors]]]
        new_positions, new_attend = verification_inputs(new_parents, committed)
        if corrections:
            rows = slice(len(survivors) + 1, None)
            states.append(self._run_corrections(state, new_tokens[len(survivors):], new_positions[rows], new_attend[rows]))
        shallow_hidden = torch.cat(states, dim=1)
        tock = time.perf_counter()
        deep = model.forward_layers(shallow_hidden, self.layer, model.num_layers, cache, position_ids=new_positions,
                                    attend=new_attend)
        target_logits = model.head(deep[0])
        self._count(parents, tokens, pruned, survivors, target_logits, len(corrections), tick, tock)
        verified = Proposal(tokens=torch.tensor(new_tokens, dtype=torch.long), parents=new_parents,
                            hidden=shallow_hidden, hidden_layer=self.layer)
        return verified, target_logits

    def _run_corrections(self, state: DecodeState, tokens: list[int], positions: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """Correction nodes through ``[0, L_sv)`` (and the draft and shallow adapters, to keep their caches in step);
        their states after L_sv, ``[1, c, H]``."""
        model, cache = self.model, state.cache
        hidden = model.embed(torch.tensor(tokens))
        split = self.drafter.layer if self.drafter is not None else 0
        hidden = model.forward_layers(hidden, 0, split, cache, position_ids=positions, attend=attend)
        if self.drafter is not None and self.drafter.adapter is not None:
            self.drafter.adapter(hidden, cache, positions, attend=attend)
        hidden = model.forward_layers(hidden, split, self.layer, cache, position_ids=positions, attend=attend)
        self.shallow(hidden, cache, positions, attend=attend)
        return hidden

    def _count(self, parents, tokens, pruned, survivors, target_logits, corrected, tick, tock) -> None:
        counts, choice = self.counts, target_logits.argmax(-1)
        row_of = {-1: 0, **{node: i + 1 for i, node in enumerate(survivors)}}  # target rows of verified nodes
        for node in range(len(pruned)):
            parent = int(parents[node])
            if parent not in row_of:
                counts.undecided += 1
                continue
            right = int(choice[row_of[parent]]) == int(tokens[node])
            if pruned[node]:
                counts.false_negative += right
                counts.true_negative += not right
            else:
                counts.true_positive += right
                counts.false_positive += not right
        counts.nodes_drafted += len(pruned)
        counts.nodes_pruned += sum(pruned)
        counts.nodes_corrected += corrected
        counts.nodes_verified += len(survivors) + corrected
        counts.steps += 1
        counts.shallow_s += tock - tick
        counts.deep_s += time.perf_counter() - tock


def make_scorer(method: str, model: LayeredModel, drafter, adapters: str | None = None, sv_threshold: float = 0.05):
    """The scorer a method verifies with: the cascade for ``cats`` (its shallow adapter from ``adapters``), else the
    plain target."""
    from cats.draft.adapter import find_adapter, load_adapter
    from cats.verify import TargetScorer

    if method != "cats":
        return TargetScorer()
    shallow = load_adapter(find_adapter(adapters, "shallow"), model, role="shallow")
    from cats.memory.offload import check_resident

    check_resident(model, shallow.config.layer, f"the shallow verifier at layer {shallow.config.layer}")
    return CascadeScorer(model, shallow, drafter=drafter, sv_threshold=sv_threshold)
