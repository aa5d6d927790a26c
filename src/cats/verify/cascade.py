"""The cascade: a shallow verifier between the draft and the full target (the "C" in CATS).

For a drafted tree (or chain) over ``[x, n_0 .. n_{k-1}]`` whose states after layer L_d the drafter left behind:

1. layers ``[L_d, L_sv)`` run on all nodes (tree mask), reusing the draft's K/V for ``[0, L_d)``;
2. the shallow adapter at L_sv gives its own next-token distribution after x and after every node;
3. (a) a node whose token the shallow verifier gives probability below ``sv_threshold`` is pruned with its subtree;
   (b) where the shallow verifier's top token after x or after an expanded node is none of the drafted children,
   it is added as a correction branch (run once through ``[0, L_sv)``, and the draft adapter, to join the tree);
4. the cache layers ``[0, L_sv)`` (and the adapters') keep only the surviving nodes;
5. with ``sv_passes`` N > 1, up to N - 1 more rounds: from the end of the path the shallow verifier itself would
   accept (its top token at every step), append its next top token and draft a chain from there with the draft head
   (``[0, L_d)`` + draft adapter), run the chain through ``[L_d, L_sv)`` and check it as in 3;
6. the deep layers ``[L_sv, N)`` run once, on the surviving tree only.

No layer runs twice for the same node, and the full target still decides every token, so greedy output is
unchanged (lossless); the cascade only decides which nodes the deep layers spend their time on.

Under speculative sampling the drafted nodes were drawn from q (`Proposal.draws`). Removing a drawn node because
of its own token would bias the test of its siblings, so a pruned drawn node stays in its parent's draw as an
*unverified* candidate: the deep layers skip it and its subtree, and if the target accepts it, it is the step's last
token. Corrections and redrafted chains are deterministic children: the walk goes on below one when the target's
own sample is its token. Both keep the output's distribution exactly that of plain sampling (see `cats.verify.acceptance`).

Counters per generation (`ShallowCounts`): for every drafted node whose parent the target verified, the shallow
decision (keep / prune) against the target's (the node's token is the target's choice at its parent): TP = kept
and right, FP = kept and wrong, TN = pruned and wrong, FN = pruned and right; nodes whose parent was pruned too have
no target decision and are counted as ``undecided``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from cats.draft.base import DecodeState, Draw, Proposal
from cats.draft.early_exit import EarlyExitDrafter
from cats.errors import InvalidArgumentError
from cats.model import LayeredModel
from cats.model.adapter import Adapter, find_adapter, load_adapter
from cats.tree import chain_parents, verification_inputs

# The default --sv-threshold: prune a node whose token the shallow verifier gives less than this. Measured on SmolLM2
# bf16 (docs/benchmarks.md, "Confidence stop"): 0.05 > 0.1 > 0.2 > 0.3 in tokens/s; pruning saves little deep work on
# a resident model and every wrongly pruned node costs its accepted tokens.
SV_THRESHOLD = 0.05


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
    redraft_passes: int = 0  # extra shallow passes (--sv-passes above 1) that added a redrafted chain
    nodes_redrafted: int = 0  # drafted nodes of those chains (part of nodes_drafted; their first node, the
    # shallow verifier's own choice, is counted as a correction)
    shallow_s: float = 0.0  # layers [L_d, L_sv), the shallow adapter, corrections and redrafts
    redraft_s: float = 0.0  # the redraft part of shallow_s
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
        sv_passes: shallow passes per deep pass (CATS' name). Each pass after the first follows the shallow
            verifier's own top tokens from x to the end of that path, appends its top token there, drafts a chain
            from it with the draft head (``drafter.num_tokens`` at most, confidence stop as the drafter's), runs the
            chain through ``[L_d, L_sv)`` and checks it like the first. Needs an early-exit or tree drafter.
    """

    name = "cascade"
    cache_layers = 1

    def __init__(self, model: LayeredModel, shallow: Adapter, drafter: EarlyExitDrafter | None = None,
                 sv_threshold: float = SV_THRESHOLD, corrections: bool = True, sv_passes: int = 1):
        self.model, self.shallow, self.drafter = model, shallow, drafter
        self.layer = shallow.config.layer
        if drafter is not None and drafter.layer >= self.layer:
            raise InvalidArgumentError(f"the shallow verifier's layer ({self.layer}) must lie above the draft layer "
                                       f"({drafter.layer})")
        if not 0.0 <= sv_threshold < 1.0:
            raise InvalidArgumentError(f"--sv-threshold must lie in [0, 1), got {sv_threshold}")
        if not isinstance(sv_passes, int) or sv_passes < 1:
            raise InvalidArgumentError(f"--sv-passes must be a positive integer, got {sv_passes!r}")
        if sv_passes > 1 and drafter is None:
            raise InvalidArgumentError("--sv-passes above 1 redrafts with the draft adapter; it needs an early-exit or "
                                       "tree drafter (methods early-exit, tree, cats), not prompt lookup")
        self.sv_threshold, self.corrections, self.sv_passes = sv_threshold, corrections, sv_passes
        self.prefill_layers = (self.layer,)
        shallow.cache_layer = model.num_layers + (drafter.cache_layers if drafter is not None else 0)
        self.counts = ShallowCounts()

    def prefill(self, state: DecodeState, hidden: dict[int, torch.Tensor]) -> None:
        self.counts = ShallowCounts()
        self.shallow(hidden[self.layer], state.cache)

    def counters(self) -> dict:
        return self.counts.to_dict()

    def describe(self) -> dict:
        return {"name": self.name, "layer": self.layer, "sv_threshold": self.sv_threshold,
                "corrections": self.corrections, "sv_passes": self.sv_passes}

    # ------------------------------------------------------------------------------------------------ the cascade
    def score(self, state: DecodeState, proposal: Proposal, max_tokens: int | None = None) -> tuple[Proposal, torch.Tensor]:
        """Check ``proposal`` with the shallow verifier (and redraft up to ``sv_passes - 1`` times, keeping every
        path at most ``max_tokens`` deep), then run the deep layers once over the surviving tree."""
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
        shallow_probs = self._shallow_probs(hidden, cache, positions, attend)
        # 3. prune and correct; the cache's shallow layers keep the survivors, corrections join them
        tree = _ShallowTree(states=[hidden[0, 0]], choices=[int(shallow_probs[0].argmax())])
        drawn: dict[int, set[int]] = {}  # drawn candidates per parent, verified or not: no correction repeats them
        for draw in proposal.draws or ():
            drawn.setdefault(draw.parent, set()).update(draw.tokens)
        index = self._check(state, tree, tokens.tolist(), parents.tolist(), shallow_probs, hidden, parent_map={-1: -1},
                            drawn=drawn)
        # 4. more shallow passes: redraft from the shallow verifier's choice after the end of its own path
        if self.sv_passes > 1 and self.drafter is not None:
            room = self.drafter.num_tokens if max_tokens is None else max_tokens
            for _ in range(self.sv_passes - 1):
                redraft_tick = time.perf_counter()
                grew = self._redraft(state, tree, room)
                self.counts.redraft_s += time.perf_counter() - redraft_tick
                if not grew:
                    break
        # 5. the deep layers, once, over the surviving tree
        new_parents = torch.tensor(tree.parents, dtype=torch.long)
        new_positions, new_attend = verification_inputs(new_parents, committed)
        shallow_hidden = torch.stack(tree.states)[None]
        tock = time.perf_counter()
        deep = model.forward_layers(shallow_hidden, self.layer, model.num_layers, cache, position_ids=new_positions,
                                    attend=new_attend)
        target_logits = model.head(deep[0])
        self._count(tree, target_logits, tick, tock)
        draws = None
        if proposal.draws is not None:  # pruned drawn nodes stay candidates, unverified (module docstring)
            draws = [Draw(index[draw.parent], draw.tokens, [index.get(node) for node in draw.nodes], draw.probs)
                     for draw in proposal.draws if draw.parent in index]
        verified = Proposal(tokens=torch.tensor(tree.tokens, dtype=torch.long), parents=new_parents,
                            hidden=shallow_hidden, hidden_layer=self.layer, draws=draws)
        return verified, target_logits

    def _shallow_probs(self, hidden: torch.Tensor, cache, positions, attend) -> torch.Tensor:
        """The shallow adapter on states after L_sv (appending its K/V): its next-token probabilities ``[T, V]``."""
        return torch.softmax(self.shallow.full_logits(self.shallow(hidden, cache, positions, attend=attend)[0]).float(), -1)

    def _shallow_layers(self) -> list[int]:
        """Cache layers holding the tree's nodes before the deep pass: ``[0, L_sv)`` and the adapters'."""
        layers = list(range(self.layer)) + [self.shallow.cache_layer]
        if self.drafter is not None and self.drafter.adapter is not None:
            layers.append(self.drafter.adapter.cache_layer)
        return layers

    def _check(self, state: DecodeState, tree: "_ShallowTree", tokens: list[int], parents: list[int],
               shallow_probs: torch.Tensor, hidden: torch.Tensor, parent_map: dict[int, int],
               first_is_correction: bool = False, drawn: dict[int, set[int]] | None = None) -> dict[int, int]:
        """Add checked nodes to ``tree``. ``tokens``/``parents`` are new nodes (parents: earlier new nodes by
        index, or tree nodes via ``parent_map``); their shallow-layer slots were appended to the cache after the
        tree's, ``hidden`` holds their states after L_sv (row 0: the node the batch hangs from, already in the tree,
        when ``parent_map`` maps -1 to it) and ``shallow_probs`` the verifier's distribution after each row.

        (a) a node whose token the verifier gives a probability below ``sv_threshold`` is pruned with its subtree;
        (b) where the verifier's top token after a kept node (or the batch root) is none of its children (nor of
        its ``drawn`` candidates, by batch parent), it is added as a correction branch.

        Returns the map from batch index (and -1) to tree index; pruned nodes are not in it."""
        committed, count, cache = state.committed_length, len(tokens), state.cache
        base = len(tree.tokens)  # tree nodes before this batch (their slots precede the batch's)
        pruned = []
        for node in range(count):
            parent = parents[node]
            unlikely = float(shallow_probs[parent + 1, tokens[node]]) < self.sv_threshold
            if first_is_correction and node == 0:
                unlikely = False  # the verifier's own choice
            pruned.append(unlikely or (parent >= 0 and pruned[parent]))
        survivors = [node for node in range(count) if not pruned[node]]
        if len(survivors) < count:
            keep = torch.arange(committed + 1 + base)
            batch = committed + 1 + base + torch.tensor(survivors, dtype=torch.long)
            cache.keep(torch.cat([keep, batch]), layers=self._shallow_layers())
        index = dict(parent_map)  # batch index -> tree index
        for node in survivors:
            index[node] = len(tree.tokens)
            tree.add(tokens[node], index[parents[node]], hidden[0, node + 1], int(shallow_probs[node + 1].argmax()))
        for node in range(count):
            if first_is_correction and node == 0:
                continue
            tree.record(tokens[node], index.get(parents[node]), pruned[node])
        if not self.corrections:
            return index
        children: dict[int, set[int]] = {}
        for node in range(count):
            children.setdefault(parents[node], set()).add(tokens[node])
        for parent, drawn_tokens in (drawn or {}).items():
            children.setdefault(parent, set()).update(drawn_tokens)
        corrections = [(index[parent], tree.choices[index[parent] + 1]) for parent in [-1] + survivors
                       if parent in children and tree.choices[index[parent] + 1] not in children[parent]]
        if corrections:
            self._add_corrections(state, tree, corrections)
        return index

    def _add_corrections(self, state: DecodeState, tree: "_ShallowTree", corrections: list[tuple[int, int]]) -> None:
        """Correction nodes ``(tree parent, token)`` through ``[0, L_sv)`` and both adapters (keeping their caches in
        step); they join the tree with their states after L_sv and the verifier's choice after them."""
        model, cache, committed = self.model, state.cache, state.committed_length
        first = len(tree.tokens)
        for parent, token in corrections:
            tree.add(token, parent, None, None)
        positions, attend = verification_inputs(torch.tensor(tree.parents, dtype=torch.long), committed)
        rows = slice(first + 1, None)
        positions, attend = positions[rows], attend[rows]
        hidden = model.embed(torch.tensor([token for _, token in corrections]))
        split = self.drafter.layer if self.drafter is not None else 0
        hidden = model.forward_layers(hidden, 0, split, cache, position_ids=positions, attend=attend)
        if self.drafter is not None and self.drafter.adapter is not None:
            self.drafter.adapter(hidden, cache, positions, attend=attend)
        hidden = model.forward_layers(hidden, split, self.layer, cache, position_ids=positions, attend=attend)
        if self.sv_passes > 1:  # a redraft may start below a correction: it needs the verifier's choice there
            choices = self._shallow_probs(hidden, cache, positions, attend).argmax(-1).tolist()
        else:  # only the verifier's K/V (later steps attend to them): its vocabulary head is not needed
            self.shallow(hidden, cache, positions, attend=attend)
            choices = [None] * len(corrections)
        for row in range(len(corrections)):
            tree.states[first + 1 + row], tree.choices[first + 1 + row] = hidden[0, row], choices[row]
        self.counts.nodes_corrected += len(corrections)

    def _redraft(self, state: DecodeState, tree: "_ShallowTree", max_depth: int) -> bool:
        """One more shallow pass: follow the verifier's own choices from x to the end of that path, add its choice
        after the end as a node, draft a chain from it with the draft head, run the chain through ``[L_d, L_sv)``
        and check it. Returns False when nothing could be added (the path is already ``max_depth`` deep)."""
        model, cache, committed, drafter = self.model, state.cache, state.committed_length, self.drafter
        end = tree.shallow_path_end()
        room = min(max_depth - tree.depth(end), drafter.num_tokens)
        if room <= 0:
            return False
        base = len(tree.tokens)
        tokens, parents, states = [tree.choices[end + 1]], [-1], []
        # draft one token at a time through [0, L_d) and the draft head, each seeing x, its tree ancestors and itself
        all_parents = tree.parents + [end]  # the tree's parents and the chain's, in tree indices
        while True:
            positions, attend = verification_inputs(torch.tensor(all_parents, dtype=torch.long), committed)
            row = len(all_parents)
            position, visible = positions[row : row + 1], attend[row : row + 1, : committed + 1 + row]
            hidden = model.forward_layers(model.embed(torch.tensor(tokens[-1:])), 0, drafter.layer, cache,
                                          position_ids=position, attend=visible)
            states.append(hidden)
            if len(tokens) == room:  # the last node only needed its state (and adapter K/V)
                if drafter.adapter is not None:
                    drafter.adapter(hidden, cache, position, attend=visible)
                break
            draft_logits = drafter.node_logits(hidden, cache, position, visible)[-1]
            if drafter.threshold > 0 and float(torch.softmax(draft_logits.float(), -1).max()) < drafter.threshold:
                break
            token = int(draft_logits.argmax())
            tokens.append(token)
            parents.append(len(tokens) - 2)
            all_parents.append(len(all_parents) - 1)
        # the batch through [L_d, L_sv) at once, then the shallow verifier
        positions, attend = verification_inputs(torch.tensor(all_parents, dtype=torch.long), committed)
        rows = slice(base + 1, base + 1 + len(tokens))
        positions, attend = positions[rows], attend[rows]
        hidden = model.forward_layers(torch.cat(states, dim=1), drafter.layer, self.layer, cache,
                                      position_ids=positions, attend=attend)
        probs = self._shallow_probs(hidden, cache, positions, attend)
        # row 0 stands for `end` (the batch's root): its distribution is the one already known
        end_row = torch.zeros(1, probs.shape[-1], dtype=probs.dtype)
        end_row[0, tree.choices[end + 1]] = 1.0
        hidden = torch.cat([hidden[:, :1], hidden], dim=1)  # row 0 unused: `end` is in the tree already
        self._check(state, tree, tokens, parents, torch.cat([end_row, probs]), hidden, parent_map={-1: end},
                    first_is_correction=True)
        self.counts.nodes_corrected += 1
        self.counts.nodes_redrafted += len(tokens) - 1
        self.counts.redraft_passes += 1
        return True

    def _count(self, tree: "_ShallowTree", target_logits: torch.Tensor, tick: float, tock: float) -> None:
        counts, choice = self.counts, target_logits.argmax(-1).tolist()
        for token, parent, pruned in tree.decisions:
            if parent is None:  # its parent was pruned: the target never judged it
                counts.undecided += 1
                continue
            right = choice[parent + 1] == token
            if pruned:
                counts.false_negative += right
                counts.true_negative += not right
            else:
                counts.true_positive += right
                counts.false_positive += not right
        counts.nodes_drafted += len(tree.decisions)
        counts.nodes_pruned += sum(pruned for _, _, pruned in tree.decisions)
        counts.nodes_verified += len(tree.tokens)
        counts.steps += 1
        counts.shallow_s += tock - tick
        counts.deep_s += time.perf_counter() - tock


@dataclass
class _ShallowTree:
    """The tree as the shallow layers leave it: node i is cache slot ``committed + 1 + i``; index -1 is x.

    ``states[i + 1]`` is node i's state after L_sv (``states[0]``: x's), ``choices[i + 1]`` the shallow verifier's
    top token after it (None after a correction when no redraft can start there: ``sv_passes`` 1). ``decisions``
    lists every drafted node the verifier judged: (token, tree index of its parent or None when the parent was
    pruned, pruned)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    states: list = field(default_factory=list)
    choices: list = field(default_factory=list)
    decisions: list = field(default_factory=list)

    def add(self, token: int, parent: int, state, choice) -> None:
        self.tokens.append(token)
        self.parents.append(parent)
        self.states.append(state)
        self.choices.append(choice)

    def record(self, token: int, parent: int | None, pruned: bool) -> None:
        self.decisions.append((token, parent, pruned))

    def depth(self, node: int) -> int:
        depth = 0
        while node >= 0:
            node, depth = self.parents[node], depth + 1
        return depth

    def shallow_path_end(self) -> int:
        """The last node of the path that follows the shallow verifier's top token from x (-1: x itself)."""
        children: dict[int, dict[int, int]] = {}
        for node, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            children.setdefault(parent, {})[token] = node
        node = -1
        while self.choices[node + 1] in children.get(node, {}):
            node = children[node][self.choices[node + 1]]
        return node


def make_cascade(model: LayeredModel, drafter, adapters: str | None, sv_threshold: float = SV_THRESHOLD,
                 sv_passes: int = 1) -> "CascadeScorer":
    """The cascade over ``drafter``'s trees, with the shallow adapter of ``adapters`` (``DIR/shallow/``)."""
    shallow = load_adapter(find_adapter(adapters, "shallow"), model, role="shallow")
    # under a memory budget that streams some of [0, L_sv), a correction branch would read them a second time per
    # pass (out of access order): the cascade then only prunes (still lossless: corrections only add candidates)
    plan = model.memory_plan
    corrections = not (model.weights is not None and plan.resident_prefix < shallow.config.layer)
    return CascadeScorer(model, shallow, drafter=drafter, sv_threshold=sv_threshold, corrections=corrections,
                         sv_passes=sv_passes)
