"""DyTC: the estimates (windowed acceptance average, recursive least squares), the decisions on hand-made drafters
with known acceptance and latency, losslessness on every family, the method, and the counters in stats/bench."""

from __future__ import annotations

import gc
import itertools
import random

import numpy as np
import pytest
import torch

from cats.draft import LayerSkipDrafter, PromptLookupDrafter, SkipSet
from cats.methods import make_drafter
from cats.draft.base import DecodeState, Drafter, Proposal
from cats.draft.dytc.estimates import AcceptanceEstimate, LatencyModel, WindowedAverage, expected_accepted, match_class
from cats.draft.dytc.scheduler import DraftOption, DyTCDrafter
from cats.draft.dytc.hindsight import TREE_SIZES, HindsightRecord, HindsightYield, best_cut
from cats.draft.dytc import cost
from cats.draft.dytc.cost import CostShape, VerifyCost, measure_shape
from cats.draft.prompt_lookup import LookupMatch
from cats.errors import InvalidArgumentError
from cats.config import GenerationConfig
from cats.loop.generator import Generator
from tests.conftest import FAMILIES, VOCAB, hf_greedy, proposal_sizes, tiny_model
from cats.config import DraftConfig


def test_expected_accepted():
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(1.0, 4) == 4 and expected_accepted(0.0, 4) == 0 and expected_accepted(0.7, 0) == 0


def test_windowed_average_weights_and_window():
    average = WindowedAverage(prior=0.5, decay=0.7, window=20)
    assert average.ratio(step=1) == 0.5  # the prior alone
    average.observe(1, 1.0)
    average.observe(2, 0.0)
    # newest weight 1, then 0.7, then the prior 0.49
    assert average.ratio(2) == pytest.approx((0.0 + 0.7 * 1.0 + 0.49 * 0.5) / (1 + 0.7 + 0.49))
    assert average.ratio(21) == pytest.approx((0.0 + 0.7 * 0.5) / 1.7)  # step 1 left the 20-step window
    assert average.ratio(22) == 0.5 and average.count(22) == 0  # nothing left: back to the prior
    alpha = AcceptanceEstimate(prior=0.5)
    for step in range(1, 11):
        alpha.observe_step(step, 3, 4)  # 3 accepted, then a rejection: trials 4
    assert alpha.value(10) == pytest.approx(0.75, abs=0.01)
    alpha.observe_step(11, 4, 4)  # all accepted: no failure observed
    assert alpha.value(11) > 0.75


def test_a_benched_drafter_returns_to_its_long_run_acceptance():
    """A run of rejections benches a drafter; each step it is not chosen its recent steps fade (decay per step) and
    the estimate returns to its long-run rate, so a good drafter is tried again within a few steps and a drafter
    that usually fails stays benched."""
    good, poor = AcceptanceEstimate(prior=0.5), AcceptanceEstimate(prior=0.5)
    for step in range(1, 31):
        good.observe_step(step, 3, 4)  # 3 accepted, then a rejection: 0.75 per token
        poor.observe_step(step, 0, 4)  # the first token rejected: 0 per token
    for step in range(31, 36):
        good.observe_step(step, 0, 4)  # five rejections in a row
    assert good.value(35) < 0.45 and good.long_run(35) > 0.65
    assert good.value(43) > 0.6 > good.value(36)  # 8 steps later: nearly back
    assert poor.value(43) < 0.05 and poor.long_run(43) < 0.05
    decay = 0.7  # the recent steps by age, the long-run rate as one trial
    fresh = AcceptanceEstimate(prior=0.5, decay=decay)
    fresh.observe_step(1, 2, 4)
    fresh.observe_step(3, 4, 4)
    long_run = (0.99 ** 2 * 2 + 4 + 0.5) / (0.99 ** 2 * 3 + 4 + 1)  # 2 of 4: 3 trials; 4 of 4: 4
    assert fresh.long_run(3) == pytest.approx(long_run)
    assert fresh.value(3) == pytest.approx((long_run + 4 + decay ** 2 * 2) / (1 + 4 + decay ** 2 * 3))


def test_recursive_least_squares_recovers_a_linear_cost():
    model = LatencyModel(slope_share=0.1, forgetting=0.98)
    rng = random.Random(0)
    for step in range(200):
        n = 1 + step % 9
        model.observe(n, 0.012 + 0.003 * n + rng.gauss(0, 1e-5))
    a, b = model.coefficients()
    assert a == pytest.approx(0.012, rel=0.02) and b == pytest.approx(0.003, rel=0.02)
    assert model.predict(20) == pytest.approx(0.072, rel=0.02)
    constant = LatencyModel(slope_share=0.1)
    for _ in range(1000):
        constant.observe(3, 0.013)  # one n only: the slope keeps the prior shape; no wind-up
    assert constant.predict(3) == pytest.approx(0.013, rel=1e-3) and constant.coefficients()[1] > 0


def test_verify_cost_scales_the_measured_shape_and_learns_the_context_term():
    """The shape in n is measured at a short context; online, the fit follows a slower machine, a fixed overhead per
    step and attention that grows with the context and the token count, for sizes it never observed too."""
    def forward(n, context):  # flat up to 4 tokens, 1 ms per token beyond; attention 4 ms + 0.5 ms per token per 1k
        return 0.020 + 0.001 * max(n - 4, 0) + 0.004 * context / 1000 + 0.0005 * n * context / 1000

    shape = CostShape.of({n: forward(n, 64) for n in (1, 2, 4, 8, 16, 32)}, context=64)
    cost = VerifyCost(forgetting=0.99, shape=shape)
    assert cost.ready and cost.predict(16, 64) == pytest.approx(forward(16, 64))  # the measurement is the prior
    assert cost.predict(20, 64) == pytest.approx(forward(20, 64))  # linear in between measured sizes

    def truth(n, context):  # the machine is 30 % slower now, and each step pays 2 ms of bookkeeping
        return 1.3 * forward(n, context) + 0.002

    rng = random.Random(1)
    for _ in range(600):  # only small sizes observed
        n, context = rng.choice([1, 2, 3, 5, 8]), rng.choice([50, 300, 800, 1500])
        cost.observe(n, context, truth(n, context) * (1 + rng.gauss(0, 0.01)))
    for n in (1, 4, 8, 16, 32):
        for context in (100, 1000):
            assert cost.predict(n, context) == pytest.approx(truth(n, context), rel=0.05), (n, context)
    cost.observe(16, 1000, 10.0)  # one step descheduled by the OS: clipped to 1.5x the prediction
    assert cost.predict(16, 1000) == pytest.approx(truth(16, 1000), rel=0.15)
    curve = cost.curve(500, 40)
    assert all(b >= a for a, b in zip(curve[1:], curve[2:]))  # more tokens never cost less
    fresh = VerifyCost()
    fresh.observe(1, 100, 0.030)
    assert fresh.predict(12, 100) == pytest.approx(0.030)  # unmeasured: flat, untried sizes look as cheap


def test_verify_cost_never_extrapolates_to_attention_that_gets_cheaper_with_context():
    """Large trees verified cheaper than the shape says at one long context (noise, a machine that sped up) must not
    turn the context terms negative: at a longer context 32 tokens would then cost about one token's time."""
    def forward(n):  # no attention term at all: what the short-context shape measured
        return 0.038 + 0.011 * (n - 1)

    cost = VerifyCost(shape=CostShape.of({n: forward(n) for n in (1, 2, 4, 8, 16, 32)}, context=64))
    for _ in range(200):
        cost.observe(4, 100, forward(4))
    for _ in range(200):
        cost.observe(1, 800, forward(1))
        cost.observe(16, 800, 0.6 * forward(16))
    assert cost.coefficients()[2] < 0  # the fit itself would have attention get cheaper with context
    assert cost.predict(32, 1500) >= 0.5 * forward(32)  # as fitted: 0.056 s, against 0.379 measured at 64
    assert all(cost.predict(n, 1500) >= cost.predict(n, 800) for n in (1, 4, 16, 32))
    assert cost.predict(1, 800) == pytest.approx(forward(1), rel=0.2)  # what was observed still holds


def test_cost_shapes_are_made_non_decreasing_from_the_right():
    shape = CostShape.of({1: 0.020, 2: 0.026, 4: 0.021, 8: 0.030}, context=10)
    assert shape.seconds == pytest.approx((0.020, 0.021, 0.021, 0.030))  # 2 tokens measured slow: a timing spike
    assert shape.relative([1, 3, 8, 12]).tolist() == pytest.approx([1.0, 1.05, 1.5, 1.95])  # beyond: the last slope
    with pytest.raises(ValueError):
        CostShape((2, 4), (0.01, 0.02))


def test_measure_shape_times_every_size_on_the_model():
    model = tiny_model("llama")
    ticks = iter(range(10_000))
    shape = measure_shape(model, sizes=(1, 2, 4), context=8, repeats=2, clock=lambda: float(next(ticks)))
    assert shape.tokens == (1, 2, 4) and shape.context == 8
    assert shape.seconds == (1.0, 1.0, 1.0)  # each timed call reads the clock twice: one tick per forward
    assert shape.measure_s > 0


def test_the_shape_is_measured_once_per_model_and_thread_count(monkeypatch):
    calls = []
    monkeypatch.setattr(cost, "measure_shape", lambda model: calls.append(id(model)) or CostShape.flat())
    first, second = tiny_model("llama"), tiny_model("llama")
    threads = torch.get_num_threads()
    try:
        assert cost.measured_shape(first) is cost.measured_shape(first)  # a second drafter for the same model
        cost.measured_shape(second)
        torch.set_num_threads(1 if threads > 1 else 2)
        cost.measured_shape(first)  # another thread count: another forward time
    finally:
        torch.set_num_threads(threads)
    assert calls == [id(first), id(second), id(first)]
    entries = len(cost._MEASURED)
    del second
    gc.collect()
    assert len(cost._MEASURED) == entries - 1  # a model's measurements go with it


def test_hindsight_records_score_every_cut_once_decided():
    # tree: 5 (priority 0) -> 7 (priority 1); 6 (priority 2); chain [5, 7, 9]
    record = HindsightRecord(ngram=2, before=3, tree_tokens=[5, 6, 7], tree_parents=[-1, -1, 0],
                             tree_priority=[0, 2, 1], chain=[5, 7, 9])
    assert record.score([]) is None  # nothing committed yet
    assert record.score([5]) is None  # 5 accepted: its child 7 and the chain's 7 are still open
    assert record.score([5, 7]) is None  # the chain's 9 is still open
    tree, chain = record.score([5, 7, 8])
    assert chain == 2 and tree.tolist() == [1, 2, 2, 2, 2, 2, 2, 2]  # the cut to 1 node holds 5 only
    tree, chain = record.score([6, 1])  # decided at once: the root's children miss, bar 6 (no children)
    assert chain == 0 and tree.tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    assert HindsightRecord(0, 3, [], [], [], [4]).score([3]) == (pytest.approx([0] * len(TREE_SIZES)), 0)


def test_hindsight_yield_expects_the_union_of_tree_and_chain():
    yields = HindsightYield(decay=0.5, window=10)
    tree_a = [1, 1, 1, 2, 2, 2, 2, 2]  # per cut size of TREE_SIZES
    yields.observe(1, 1, np.array(tree_a, dtype=float), 3)
    yields.observe(2, 1, np.zeros(len(TREE_SIZES)), 0)
    expected = yields.expected(2, 1, 4)
    # newest weight 1, then 0.5, then the prior (all zeros) 0.25
    weights = np.array([0.25, 0.5, 1.0])
    def mean(values):
        return float((weights * np.array(values)).sum() / weights.sum())
    assert expected[0, 0] == 0 and expected[0, 2] == pytest.approx(mean([0, 2, 0]))  # chain of 2: min(2, 3)
    assert expected[1, 0] == pytest.approx(mean([0, 1, 0]))  # the tree cut to 1 node
    assert expected[4, 2] == pytest.approx(mean([0, 2, 0]))  # cut to 4 nodes (2) or chain of 2 (2)
    assert expected[4, 4] == pytest.approx(mean([0, 3, 0]))  # max(2, min(4, 3))
    assert yields.count(11, 1) == 1 and yields.count(12, 1) == 0  # the window is in decode steps
    assert yields.expected(12, 1, 4).max() == 0  # back to the prior
    from cats.draft.dytc.hindsight import YIELD_RECORDS
    for step in range(YIELD_RECORDS + 5):  # at most YIELD_RECORDS records per class: the oldest leave first
        yields.observe(20, 3, np.zeros(len(TREE_SIZES)), 1 if step < 5 else 2)
    assert yields.count(20, 3) == YIELD_RECORDS and yields.expected(20, 3, 4)[0, 4] == pytest.approx(2.0)


def test_best_cut_prefers_the_best_rate_then_fewer_tokens():
    expected = np.array([[0.0, 1.0], [0.5, 1.0]])
    tokens = np.array([[1, 2], [3, 4]])
    cost = np.array([0.0, 1.0, 1.0, 2.0, 2.0])
    assert best_cut(expected, tokens, cost)[:2] == (0, 1)  # (1 + 1) / 1.0 beats (1 + 0.5) / 2.0
    tokens[0, 1] = -1  # not available
    assert best_cut(expected, tokens, cost)[:2] == (0, 0)  # 1 / 1.0 ties (1 + 1) / 2 at fewer tokens


def test_match_classes_follow_how_far_back_a_match_holds():
    empty = np.zeros(0, dtype=np.int64)
    assert match_class(LookupMatch(empty, 0, 0)) == 0
    assert [match_class(LookupMatch(empty, 1, n)) for n in (1, 2, 3, 5, 8, 30)] == [1, 2, 3, 4, 8, 8]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeDrafter(Drafter):
    """Drafts token 7 repeatedly at ``cost`` seconds per token; the test decides acceptance."""

    def __init__(self, clock: FakeClock, cost: float):
        self.clock, self.cost, self.calls = clock, cost, 0

    def propose(self, state, max_tokens):
        self.calls += 1
        self.clock.now += self.cost * max_tokens
        return Proposal(tokens=torch.full((max_tokens,), 7, dtype=torch.long))


def simulate(dytc: DyTCDrafter, clock: FakeClock, alphas: dict[str, float], steps: int, context=None, seed=0,
             single: float = 0.011):
    """Run the scheduler against a simulated target: verifying n >= 2 tokens costs 0.01 + 0.001 n seconds, one token
    ``single`` seconds, and each drafted token of drafter ``key`` is accepted with probability ``alphas[key]``
    (given the ones before it)."""
    rng = random.Random(seed)
    state = DecodeState(model=None, cache=None, token_ids=list(context or range(100, 130)), prompt_length=5)
    chosen = []
    for _ in range(steps):
        began = clock.now
        proposal = dytc.propose(state, 64)
        decision = dytc._decision
        clock.now += 0.01 + 0.001 * (proposal.num_tokens + 1) if proposal.num_tokens else single
        accepted = 0
        while accepted < decision.k and rng.random() < alphas.get(decision.key, 0.0):
            accepted += 1
        dytc.observe(proposal, accepted)
        chosen.append((decision.key, decision.k, accepted + 1, clock.now - began))
        state.token_ids.append(1000 + len(state.token_ids))  # fresh tokens: prompt lookup finds nothing
    return chosen


def test_scheduler_picks_the_drafter_that_pays_and_learns_its_numbers():
    clock = FakeClock()
    good, bad = FakeDrafter(clock, cost=0.001), FakeDrafter(clock, cost=0.006)
    dytc = DyTCDrafter([DraftOption("bad", bad, 8, prior_acceptance=0.5, prior_cost=0.1),
                        DraftOption("good", good, 8, prior_acceptance=0.5, prior_cost=0.1)],
                       lookup=None, clock=clock)
    chosen = simulate(dytc, clock, {"good": 0.85, "bad": 0.3}, steps=300)
    late = [key for key, *_ in chosen[100:]]
    assert late.count("good") > 0.9 * len(late)
    counters = dytc.counters()
    assert counters["estimates"]["acceptance"]["good"] == pytest.approx(0.85, abs=0.12)
    verify = counters["estimates"]["verify_latency_s"]["by_tokens"]
    assert verify["4"] == pytest.approx(0.014, rel=0.05) and verify["8"] == pytest.approx(0.018, rel=0.05)
    assert counters["estimates"]["draft_latency_s"]["good"][1] == pytest.approx(0.001, rel=0.1)
    # tokens per second reached, against the best fixed length of the good drafter (brute force)
    best = max((1 + expected_accepted(0.85, k)) / (0.001 * k + 0.01 + 0.001 * (k + 1)) for k in range(1, 9))
    reached = sum(tokens for *_, tokens, _ in chosen[100:]) / sum(seconds for *_, seconds in chosen[100:])
    assert reached > 0.85 * best
    assert len({k for key, k, *_ in chosen[100:] if key == "good"}) > 1  # lengths follow the estimate


def test_scheduler_drafts_nothing_when_no_drafter_pays():
    clock = FakeClock()
    slow = FakeDrafter(clock, cost=0.02)
    dytc = DyTCDrafter([DraftOption("slow", slow, 8, prior_acceptance=0.6, prior_cost=0.5)], lookup=None, clock=clock)
    chosen = simulate(dytc, clock, {"slow": 0.1}, steps=200)
    late = [key for key, *_ in chosen[50:]]
    assert late.count("none") > 0.85 * len(late)  # only the occasional re-try: its long-run rate is low
    assert dytc.counters()["choices"]["none"] == sum(key == "none" for key, *_ in chosen)


def test_a_drafter_whose_priors_cannot_pay_is_never_tried():
    """A model drafter is tried once to measure its cost only where its priors (meant to be optimistic) beat plain
    decoding: at a forward per drafted token and 0.3 acceptance it cannot, and it never drafts; a cheap one beside it
    is tried and measured."""
    clock = FakeClock()
    costly, cheap = FakeDrafter(clock, cost=0.011), FakeDrafter(clock, cost=0.0005)
    dytc = DyTCDrafter([DraftOption("costly", costly, 8, prior_acceptance=0.3, prior_cost=1.0),
                        DraftOption("cheap", cheap, 8, prior_acceptance=0.5, prior_cost=0.05)], lookup=None,
                       clock=clock)
    simulate(dytc, clock, {"costly": 0.3, "cheap": 0.2}, steps=100)
    assert costly.calls == 0 and dytc.counters()["choices"]["costly"] == 0
    assert cheap.calls >= 1 and dytc.draft_latency["cheap"].ready


def test_a_cheap_one_token_forward_is_not_extrapolated_from_the_line():
    """On CPUs a one-token forward can cost far less than the line through multi-token verifications predicts; the
    measured shape holds it, so a drafter that would only beat the extrapolated cost is not used."""
    def target_shape(single):  # what `measure_shape` measures on `simulate`'s target
        return CostShape.of({1: single} | {n: 0.01 + 0.001 * n for n in (2, 16)})

    clock = FakeClock()
    free = FakeDrafter(clock, cost=0.0)
    dytc = DyTCDrafter([DraftOption("free", free, 8, prior_acceptance=0.5, prior_cost=0.0)], lookup=None, clock=clock,
                       verify_shape=target_shape(0.005))
    chosen = simulate(dytc, clock, {"free": 0.5}, steps=200, single=0.005)
    late = [key for key, *_ in chosen[50:]]
    assert late.count("none") > 0.85 * len(late)
    assert dytc.counters()["estimates"]["verify_latency_s"]["by_tokens"]["1"] == pytest.approx(0.005, rel=0.05)
    # the same target with an expensive one-token forward: drafting pays and is chosen
    clock = FakeClock()
    dytc = DyTCDrafter([DraftOption("free", FakeDrafter(clock, 0.0), 8, 0.5, 0.0)], lookup=None, clock=clock,
                       verify_shape=target_shape(0.011))
    late = [key for key, *_ in simulate(dytc, clock, {"free": 0.5}, steps=200, single=0.011)[50:]]
    assert late.count("free") > 0.95 * len(late)  # a run of rejections does not bench it: it usually pays


def test_prompt_lookup_is_chosen_when_its_matches_hold():
    clock = FakeClock()
    dytc = DyTCDrafter([], lookup=PromptLookupDrafter(num_tokens=10), clock=clock)
    state = DecodeState(model=None, cache=None, token_ids=list(range(50, 70)) * 3 + [50, 51, 52], prompt_length=10)
    proposal = dytc.propose(state, 64)
    assert dytc._decision.key == "pld" and proposal.tokens.tolist()[:3] == [53, 54, 55]
    assert dytc._decision.ngram == 8  # the match holds 20 tokens back: class 8+
    clock.now += 0.01
    dytc.observe(proposal, proposal.num_tokens)
    state.token_ids.extend(proposal.tokens.tolist() + [99])  # all accepted, then a token off the copy
    dytc.propose(state, 64)  # scores the previous step's chain in hindsight
    assert [chain for _, _, chain in dytc.hindsight.records[8]] == [proposal.num_tokens]
    with pytest.raises(InvalidArgumentError, match="at least one drafter"):
        DyTCDrafter([], lookup=None)
    with pytest.raises(InvalidArgumentError, match="distinct"):
        DyTCDrafter([DraftOption("pld", FakeDrafter(clock, 0.0))])


def test_prompt_lookup_length_follows_its_hindsight_yield():
    """Prompt lookup's acceptance is bursty: when recent steps of its match class either copied 3+ tokens or none, it
    drafts all it found (a geometric per-token rate would cut the draft short); when they never held, plain decoding
    is faster."""
    dytc = DyTCDrafter([], lookup=PromptLookupDrafter(num_tokens=10), clock=FakeClock())
    # verifying n tokens: 40 ms + 2 ms per token beyond the first
    dytc.verify_cost = VerifyCost(shape=CostShape.of({n: 0.040 + 0.002 * (n - 1) for n in (1, 11)}, context=100))
    dytc._context = 100
    for step, accepted in enumerate([10, 0] * 5, start=1):
        dytc.step = step
        dytc.hindsight.observe(step, 2, np.zeros(len(TREE_SIZES)), accepted)
    assert dytc.plan(64, lookup_tokens=10, ngram=2) == ("pld", 10, 0)
    assert dytc.plan(6, lookup_tokens=6, ngram=2) == ("pld", 6, 0)  # never beyond what was found
    for step in range(11, 31):  # 1-gram matches that never hold: plain decoding is faster
        dytc.step = step
        dytc.hindsight.observe(step, 1, np.zeros(len(TREE_SIZES)), 0)
    assert dytc.plan(64, lookup_tokens=10, ngram=1) == ("none", 0, 0)
    assert dytc.counters()["estimates"]["near_free_yield"]["1"]["pld"] < 0.05  # the prior's weight: 0.9^20


def test_recycling_is_cut_to_the_size_that_pays():
    """Token recycling's tree is drafted in full every step; the scheduler verifies the cut (and prompt lookup's
    chain grafted in) with the most expected tokens per second."""
    from cats.draft.recycle import TokenRecyclingDrafter

    model = tiny_model("llama")
    recycle = TokenRecyclingDrafter(model.vocab_size, total_tokens=16, depth=6)
    dytc = DyTCDrafter([DraftOption("recycle", recycle, 16, 0.5, 0.0, tree=True, hindsight=True)],
                       lookup=PromptLookupDrafter(num_tokens=4), clock=FakeClock())
    # flat up to 5 tokens, then 5 ms per token
    dytc.verify_cost = VerifyCost(shape=CostShape.of({n: 0.030 + 0.005 * max(n - 5, 0) for n in (1, 5, 20)}, context=10))
    for step in range(1, 21):  # every cut accepts up to 1 token, the cuts of 4 and more nodes 2
        dytc.step = step
        dytc.hindsight.observe(step, 0, np.array([1, 1, 1, 2, 2, 2, 2, 2], dtype=float), 0)
    recycle.table[:] = np.arange(recycle.candidates)[None, :] + 3  # every token has candidates 3..10
    state = DecodeState(model=model, cache=None, token_ids=[20, 21, 22], prompt_length=3)
    proposal = dytc.propose(state, 64)
    assert dytc._decision.key == "recycle" and proposal.num_tokens == 4  # 4 nodes: 5 tokens, still flat
    assert proposal.parents.tolist() == [-1, -1, 0, 2]  # x -> 3 -> 3 -> 3 and x -> 4: the 4 likeliest paths


def test_no_pass_holds_more_than_the_plan_reserved():
    """Under a memory budget the plan reserves the activations of one pass size: every chain, look-ahead, cut of the
    recycling tree (with the lookup chain grafted in) and model tree stays within it."""
    from cats.draft.recycle import TokenRecyclingDrafter

    clock = FakeClock()
    chain = FakeDrafter(clock, cost=0.0001)
    tree = FakeDrafter(clock, cost=0.0)
    dytc = DyTCDrafter([DraftOption("chain", chain, 8, prior_acceptance=0.95, prior_cost=0.01),
                        DraftOption("tree", tree, 8, prior_acceptance=0.99, prior_cost=0.0, tree=True)],
                       lookup=PromptLookupDrafter(num_tokens=8), lookahead_tokens=4, clock=clock, max_pass_tokens=4)
    sizes = proposal_sizes(dytc)
    chosen = simulate(dytc, clock, {"chain": 0.95, "pld": 0.9}, steps=60, context=list(range(100, 120)) * 3)
    assert max(sizes) == 3 and max(k for key, k, *_ in chosen if key == "chain") == 3  # x and 3 drafts at most
    assert tree.calls == 0  # its 8 nodes and x never fit a 4-token pass
    model = tiny_model("llama")
    recycle = TokenRecyclingDrafter(model.vocab_size, total_tokens=16, depth=6)
    dytc = DyTCDrafter([DraftOption("recycle", recycle, 16, 0.5, 0.0, tree=True, hindsight=True)],
                       lookup=PromptLookupDrafter(num_tokens=4), clock=FakeClock(), max_pass_tokens=3)
    dytc.verify_cost = VerifyCost(shape=CostShape.of({n: 0.030 for n in (1, 20)}, context=10))  # flat: more pays
    for step in range(1, 21):  # every larger cut accepts one token more: the larger the better
        dytc.step = step
        dytc.hindsight.observe(step, 0, np.arange(1, len(TREE_SIZES) + 1, dtype=float), 0)
    recycle.table[:] = np.arange(recycle.candidates)[None, :] + 3
    state = DecodeState(model=model, cache=None, token_ids=[20, 21, 22], prompt_length=3)
    proposal = dytc.propose(state, 64)
    assert dytc._decision.key == "recycle" and proposal.num_tokens == 2  # x and 2 nodes: the whole pass
    with pytest.raises(InvalidArgumentError, match="max_pass_tokens"):
        DyTCDrafter([], lookup=PromptLookupDrafter(), max_pass_tokens=0)


def dytc_for(model, adapter=None):
    """A DyTC over hand-picked skip sets (no calibration), a nested cascade, token recycling and optionally a draft
    adapter."""
    from cats.draft import EarlyExitDrafter, TreeDrafter
    from cats.draft.recycle import TokenRecyclingDrafter

    bottom = PromptLookupDrafter(num_tokens=6)
    dense = LayerSkipDrafter(model, SkipSet(attention=(2,), mlp=(1,)), num_tokens=6, assist=bottom)
    sparse = LayerSkipDrafter(model, SkipSet(attention=(1, 2), mlp=(1, 2, 3)), num_tokens=6, assist=bottom)
    nested = LayerSkipDrafter(model, SkipSet(attention=(2,), mlp=(1,)), num_tokens=6, assist=sparse)
    options = [DraftOption(d.label, d, 6, 0.7, c) for d, c in ((dense, 0.7), (sparse, 0.4))]
    options.append(DraftOption("nested", nested, 6, 0.8, 0.3))
    # token recycling's trees: with an adapter, the scheduler runs them through the adapter's layers (tree masks)
    options.append(DraftOption("recycle", TokenRecyclingDrafter(model.vocab_size, total_tokens=6, depth=3), 6, 0.5,
                               0.01, tree=True, hindsight=True))
    if adapter is not None:
        options.append(DraftOption("draft-adapter", EarlyExitDrafter(model, adapter=adapter, num_tokens=6), 6, 0.8, 0.4))
        tree = TreeDrafter(model, adapter=adapter, tree_topk=2, total_tokens=6, depth=3)
        options.append(DraftOption("draft-tree", tree, 6, 0.8, 0.3, tree=True))
    return DyTCDrafter(options, lookup=PromptLookupDrafter(num_tokens=8), lookahead_tokens=3)


def cycling(drafter: DyTCDrafter) -> DyTCDrafter:
    """Replace the scheduler's choice by a fixed cycle over every option and lengths 1..6, so that every branch runs
    (the look-ahead is still attached by the scheduler's own rule)."""
    keys = ["none", "pld"] + list(drafter.options)
    steps = itertools.count()

    def plan(max_tokens, lookup_tokens=0, ngram=0, free=None):
        i = next(steps)
        key, k = keys[i % len(keys)], 1 + (i // len(keys)) % 6
        if key == "pld":
            k = min(k, lookup_tokens)
        k = min(k, max_tokens)
        # the third entry, prompt lookup's tokens grafted into a recycling tree: all it found
        return ("none", 0, 0) if key == "none" or k == 0 else (key, k, lookup_tokens)

    drafter.plan = plan
    return drafter


@pytest.mark.parametrize("family", FAMILIES)
def test_dytc_equals_greedy(family):
    from cats.model.adapter import new_adapter

    model = tiny_model(family, damp=0.1)
    torch.manual_seed(0)
    adapter = new_adapter(model, "draft", 2)
    g = torch.Generator().manual_seed(5)
    for prompt in (torch.randint(3, VOCAB, (9,), generator=g).tolist(), torch.randint(3, VOCAB, (6,), generator=g).tolist() * 3):
        expected = hf_greedy(model, prompt, 40)
        for drafter in (dytc_for(model), cycling(dytc_for(model)), cycling(dytc_for(model, adapter=adapter))):
            result = Generator(model, drafter).generate(prompt, GenerationConfig(max_new_tokens=40))
            assert result.token_ids == expected, (family, drafter.counters()["choices"])
            assert result.stats.scheduler["choices"] == drafter.counters()["choices"]


def test_every_option_and_the_lookahead_get_used():
    """The lossless test above must exercise every branch: each drafter, prompt lookup and attached look-aheads."""
    from cats.model.adapter import new_adapter

    model = tiny_model("llama", damp=0.1)
    torch.manual_seed(0)
    drafter = cycling(dytc_for(model, adapter=new_adapter(model, "draft", 2)))
    prompt = torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(5)).tolist() * 3
    stats = Generator(model, drafter).generate(prompt, GenerationConfig(max_new_tokens=120, ignore_eos=True)).stats
    choices = stats.scheduler["choices"]
    assert all(choices[key] > 0 for key in choices if key != "none"), choices
    assert stats.scheduler["lookahead"]["steps"] > 0 and stats.accepted_draft_tokens > 0
    assert "scheduler: chose" in stats.summary_line()


def test_dytc_method_calibrates_once_and_reports(tmp_path, monkeypatch):
    monkeypatch.setenv("CATS_CACHE", str(tmp_path))
    model = tiny_model("llama", damp=0.1)
    drafter = make_drafter("dytc", model, DraftConfig(num_draft_tokens=5))
    assert list(drafter.options) == ["recycle", "ls0.4<pld", "ls0.6<pld", "ls0.4<ls0.6<pld"]
    assert (tmp_path / "skip-sets").is_dir()
    layer_skip = make_drafter("layer-skip", model, DraftConfig(sparsity=0.6))
    assert layer_skip.skip == drafter.options["ls0.6<pld"].drafter.skip and layer_skip.agreement is not None
    assert layer_skip.tree_topk == 1 and layer_skip.num_tokens == 4  # a chain unless told
    skip_tree = make_drafter("layer-skip", model, DraftConfig(sparsity=0.6, tree_topk=3, depth=4))
    assert (skip_tree.tree_topk, skip_tree.num_tokens, skip_tree.total_tokens) == (3, 4, 16)
    assert skip_tree.describe()["depth"] == 4 and "num_tokens" not in skip_tree.describe()
    prompt = [5, 6, 7, 8] * 4
    result = Generator(model, drafter).generate(prompt, GenerationConfig(max_new_tokens=30))
    assert result.token_ids == hf_greedy(model, prompt, 30)
    from cats.model.adapter import new_adapter

    torch.manual_seed(0)
    new_adapter(model, "draft", 2).save(tmp_path / "adapters" / "draft")
    with_adapter = make_drafter("dytc", model, DraftConfig(adapters=str(tmp_path / "adapters"), total_tokens=8, depth=3))
    assert list(with_adapter.options)[-2:] == ["draft-adapter", "draft-tree"] and with_adapter.cache_layers == 1
    result = Generator(model, with_adapter).generate(prompt, GenerationConfig(max_new_tokens=30))
    assert result.token_ids == hf_greedy(model, prompt, 30)
    # dytc-free: the same scheduler without the adapters, even where a run passes them to the other methods
    free = make_drafter("dytc-free", model, DraftConfig(num_draft_tokens=5))
    assert list(free.options) == list(drafter.options) and free.cache_layers == 0
    with pytest.raises(InvalidArgumentError, match="--adapters does not apply to 'dytc-free'"):
        make_drafter("dytc-free", model, DraftConfig(adapters=str(tmp_path / "adapters")))
    assert Generator(model, free).generate(prompt, GenerationConfig(max_new_tokens=30)).token_ids == result.token_ids
    with pytest.raises(InvalidArgumentError, match="--sparsity applies to layer-skip and dytc"):
        make_drafter("pld", model, DraftConfig(sparsity=0.4))
    with pytest.raises(InvalidArgumentError, match="layer-skip takes one sparsity"):
        make_drafter("layer-skip", model, DraftConfig(sparsity=(0.4, 0.6)))
    with pytest.raises(InvalidArgumentError, match="--threshold does not apply to dytc"):
        make_drafter("dytc", model, DraftConfig(threshold=0.3))
    with pytest.raises(InvalidArgumentError, match="--adapters does not apply to layer-skip"):
        make_drafter("layer-skip", model, DraftConfig(adapters="somewhere"))


def test_scheduler_counters_are_summed_in_bench_summaries():
    from cats.bench.summary import scheduler_totals

    def turn(none, pld, drafted, accepted, alpha):
        return {"choices": {"none": none, "pld": pld}, "drafted": {"pld": drafted}, "accepted": {"pld": accepted},
                "lookahead": {"steps": 0, "tokens": 0, "accepted": 0},
                "estimates": {"acceptance": {}, "pld_acceptance": {"2": alpha}}}

    answers = [{"choices": [{"scheduler": [turn(3, 1, 4, 2, 0.4)]}]},
               {"choices": [{"scheduler": [turn(1, 3, 12, 3, 0.3)]}]}]
    total = scheduler_totals(answers)
    assert total["choices"] == {"none": 4, "pld": 4} and total["choice_share"] == {"none": 0.5, "pld": 0.5}
    assert total["acceptance"] == {"pld": round(5 / 16, 4)} and total["estimates"]["pld_acceptance"] == {"2": 0.3}
    assert scheduler_totals([{"choices": [{}]}]) is None


def test_near_free_drafts_are_scored_in_hindsight_whatever_was_chosen():
    """Every step's recycling tree and prompt-lookup chain become a record, scored once the committed tokens decide
    it, into the yields of the step's match class."""
    from cats.draft.recycle import TokenRecyclingDrafter

    model = tiny_model("llama")
    option = DraftOption("recycle", TokenRecyclingDrafter(model.vocab_size), 6, 0.5, 0.01, tree=True, hindsight=True)
    drafter = DyTCDrafter([option], lookup=None)
    drafter._records.extend([
        HindsightRecord(0, 3, [5, 6, 7], [-1, -1, 0], [0, 1, 2], []),  # 5 -> 7 matches both tokens after x
        HindsightRecord(2, 3, [6], [-1], [0], [5, 7, 8]),  # a chain of which 2 hold
        HindsightRecord(0, 5, [9, 9], [-1, 0], [0, 1], []),  # 9 -> 9 after position 5: the second is still open
    ])
    drafter.step = 1
    drafter._score_hindsight(DecodeState(model, model.new_cache(), [1, 2, 3, 5, 7, 9], 3))
    assert [tree.tolist() for _, tree, _ in drafter.hindsight.records[0]] == [[1, 1, 2, 2, 2, 2, 2, 2]]
    assert [(tree.max(), chain) for _, tree, chain in drafter.hindsight.records[2]] == [(0, 2)]
    assert [(r.before, r.tree_tokens) for r in drafter._records] == [(5, [9, 9])]
    assert drafter.counters()["hindsight_scored"] == 2
    assert drafter.counters()["estimates"]["pld_acceptance"]["2"] < 0.7  # the chain's rate learned from it
