"""DyTC scheduling (CAS-Spec's Dynamic Tree Cascade, for chains): each step, pick the drafter and the draft length
that maximise the expected tokens per unit of predicted time, from estimates learned while decoding.

Options each step (all from the target itself, or a trained draft adapter):

* no draft (plain decoding: 1 token for one 1-token target forward);
* the near-free drafts, which run no model layer: prompt lookup's continuation and token recycling's tree
  (`cats.draft.recycle`), both drafted every step *before* deciding. The scheduler verifies the best *cut* of them:
  the recycling tree cut to its m most probable template nodes (m in `cats.draft.dytc.hindsight.TREE_SIZES`, or none),
  with the chain's first k tokens grafted in as one more branch (k from 0 to all it found). Each (m, k) is judged
  by its expected accepted tokens -- estimated in *hindsight* from every earlier step's drafts, verified or not,
  per prompt-lookup match class (`match_class`: no match, or how far back the match holds) -- against the
  predicted cost of verifying that many tokens. Prompt lookup's acceptance is bursty (a held match often copies a
  long span, a loop repeats for good), which the per-class records capture and a geometric per-token rate does not
  (measured on Spec-Bench: with the geometric model DyTC drafted shorter than ``pld`` and reached 0.91x of it);
* each model drafter (layer-skip drafters, usually in a vertical cascade with prompt lookup under them, see
  `cats.draft.layer_skip.drafter`; the early exit through a trained draft adapter, chains and trees), at every length
  1..its maximum.

Estimates (all online):

* near-free yields (`cats.draft.dytc.hindsight`): once the committed tokens decide a step's drafts, what each cut would
  have had accepted is exact (greedy output, and sampled output with deterministic drafts, does not depend on what
  was drafted), so every step adds a record for every cut, chosen or not; up to 200 records of the last 500 steps per
  match class, weighted 0.98^age, give the expected accepted tokens of every (m, k);
* acceptance of model drafters: per drafter a per-token acceptance rate alpha, an exponential moving average with
  decay lambda = 0.7 per step over the last 20 decode steps (CAS-Spec's settings). Each step it drafted contributes
  its accepted tokens and its trials (accepted + 1 if a drafted token was rejected): the weighted geometric-model
  estimate. Its long-run rate (every step it drafted, decay 0.99 per step; the prior, layer skip's calibrated
  agreement or an adapter's held-out agreement, as one trial) enters as one more trial, and is what is left as the
  recent steps fade on steps it is not chosen: a drafter benched by a run of rejections is tried again within a few
  steps if it usually does well, and stays benched if it usually fails (`cats.draft.dytc.estimates.AcceptanceEstimate`).
  Model trees track their accepted tokens per step;
* latency: the target forward over n tokens after T cached ones (`cats.draft.dytc.cost`): its shape in n is
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
is a one-hot candidate and the output is exactly plain sampling's for the same seed (`cats.verify.acceptance`): the
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
from cats.draft.dytc.cost import CostShape, VerifyCost
from cats.draft.dytc.estimates import (
    DECAY,
    FORGETTING,
    PLD_PRIORS,
    WINDOW,
    AcceptanceEstimate,
    LatencyModel,
    WindowedAverage,
    expected_accepted,
    match_class,
)
from cats.draft.dytc.hindsight import TREE_SIZES, YIELD_DECAY, YIELD_WINDOW, HindsightRecord, HindsightYield
from cats.draft.dytc.plan import NONE, PLD, FreeDrafts, Planner
from cats.draft.dytc.report import scheduler_counters
from cats.draft.prompt_lookup import PromptLookupDrafter, lookup_match
from cats.draft.recycle import TokenRecyclingDrafter, cut, graft
from cats.errors import InvalidArgumentError
from cats.tree import is_chain, verification_inputs


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
class _Decision:
    key: str  # NONE, PLD or an option's key
    k: int  # chain tokens drafted
    extension: int = 0  # prompt-lookup tokens attached after the chain
    extension_ngram: int = 0
    ngram: int = 0  # prompt lookup chosen: the match class of its chain
    drafted_at: float = 0.0  # clock when drafting ended (verification starts)


class DyTCDrafter(Drafter, Planner):
    """Chooses, each step, no draft, the near-free drafts (prompt lookup and token recycling, cut to the sizes that
    pay), or one of the model drafters and a length (module docstring).

    Args:
        options: model drafters (at most one with its own cache layers, i.e. a trained draft adapter) and at most
            one near-free tree drafter (``hindsight=True``: token recycling).
        lookup: the prompt-lookup drafter used as an option and as the bottom look-ahead (None: neither).
        lookahead_tokens: longest prompt-lookup continuation attached after a model drafter's chain (0: none).
        decay, window: the acceptance moving average (CAS-Spec: 0.7, 20 steps).
        clock: a monotonic clock in seconds (tests pass a fake one).
        verify_shape: the measured cost of a target forward over 1..n tokens (`cats.draft.dytc.cost.measure_shape`;
            None: flat until measured online).
        max_pass_tokens: the most tokens one verification pass may hold, x included (None: no limit): under a memory
            budget, the pass whose activations the plan reserved (`cats.model.weights.offload.plan_for`); no cut,
            chain, look-ahead or tree is drafted past it.
    """

    name = "dytc"

    def __init__(self, options: Sequence[DraftOption], lookup: PromptLookupDrafter | None = None,
                 lookahead_tokens: int = 4, decay: float = DECAY, window: int = WINDOW,
                 forgetting: float = FORGETTING, clock: Callable[[], float] = time.perf_counter, features=None,
                 yield_decay: float = YIELD_DECAY, yield_window: int = YIELD_WINDOW,
                 verify_shape: CostShape | None = None, max_pass_tokens: int | None = None):
        if not options and lookup is None:
            raise InvalidArgumentError("DyTC needs at least one drafter (prompt lookup or a model drafter)")
        keys = [option.key for option in options]
        if len(set(keys)) != len(keys) or NONE in keys or PLD in keys:
            raise InvalidArgumentError(f"DyTC drafter names must be distinct and not {NONE!r} or {PLD!r}: {keys}")
        if lookahead_tokens < 0 or not 0 < decay < 1 or window < 1 or not 0 < forgetting <= 1:
            raise InvalidArgumentError("DyTC needs lookahead_tokens >= 0, 0 < decay < 1, window >= 1, "
                                       "0 < forgetting <= 1")
        if max_pass_tokens is not None and max_pass_tokens < 1:
            raise InvalidArgumentError(f"DyTC needs max_pass_tokens >= 1 (x alone), got {max_pass_tokens}")
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
        # the feature drafter (`cats.draft.eagle`) shared by its options: it takes the target's final states of
        # every committed token whichever option drafted, and catches up on them when one of its options is chosen
        self.features = features
        self.wants_features = features is not None
        self.feature_layers = features.feature_layers if features is not None else ()
        self.wants_target_logits = any(option.drafter.wants_target_logits for option in options)
        self.options = {option.key: option for option in options}
        self.recycle = free_trees[0] if free_trees else None  # the near-free tree option
        self.lookup, self.lookahead_tokens = lookup, lookahead_tokens if lookup is not None else 0
        self.decay, self.window, self.clock = decay, window, clock
        self.max_pass_tokens = max_pass_tokens
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
        if self.max_pass_tokens is not None:  # chains, trees' depth, the look-ahead: within the planned pass
            max_tokens = min(max_tokens, self.max_pass_tokens - 1)
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
        free = FreeDrafts.of(tree, priority, chain, ngram).within(self.max_pass_tokens)
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
        """Score the near-free drafts the committed tokens now decide (module `cats.draft.dytc.hindsight`):
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

    def take_features(self, final_states: torch.Tensor, layer_states: dict[int, torch.Tensor] | None = None) -> None:
        self.features.take_features(final_states, layer_states)

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
        current estimates (acceptance, the near-free drafts' yields, latency fits in seconds); built by
        `cats.draft.dytc.report`."""
        return scheduler_counters(self)

    def describe(self) -> dict:
        return {"name": self.name, "decay": self.decay, "window": self.window, "lookahead_tokens": self.lookahead_tokens,
                "lookup": self.lookup.describe() if self.lookup is not None else None,
                "max_pass_tokens": self.max_pass_tokens,
                "options": {key: {"max_tokens": o.max_tokens, "prior_acceptance": round(o.prior_acceptance, 4),
                                  "prior_cost": round(o.prior_cost, 4), "drafter": o.drafter.describe()}
                            for key, o in self.options.items()}}


__all__ = ["DraftOption", "DyTCDrafter"]
