"""Acceptance rules on synthetic distributions: speculative sampling emits exactly the target's distribution for
drawn chains, drawn trees (siblings without replacement, unverified candidates), deterministic drafts and mixtures,
and the same check fails for broken rules (mutants). Typical acceptance by hand; rule selection."""

from __future__ import annotations

import pytest
import torch

from cats.verify.acceptance import GreedyAcceptance, SpeculativeSampling, TypicalAcceptance, make_acceptance
from cats.draft.base import Draw, Proposal
from cats.errors import InvalidArgumentError
from cats.sampling import Sampler
from tests.stats_helpers import chi2_pvalue

V = 4
TRIALS = 1000
P0 = torch.tensor([0.05, 0.75, 0.10, 0.10], dtype=torch.float64)  # the target after x
Q0 = torch.tensor([0.90, 0.02, 0.04, 0.04], dtype=torch.float64)  # a draft sure of the token the target dislikes
_rows = torch.distributions.Dirichlet(torch.full((V,), 1.0, dtype=torch.float64))
torch.manual_seed(0)
P1 = _rows.sample((V,))  # P1[t]: the target after x, t
Q1 = _rows.sample((V,))  # Q1[t]: the draft after x, t


class NoResidual(SpeculativeSampling):
    """Mutant: after a rejection, go on with p instead of norm(max(p - q, 0))."""

    @staticmethod
    def residual(p, q):
        return p


class NoExclusion(SpeculativeSampling):
    """Mutant: test every sibling against the original q, as if they had been drawn with replacement."""

    @staticmethod
    def without(q, token):
        return q


class SamePosition(SpeculativeSampling):
    """Mutant: the target samples every token of a step with the noise of the step's first position."""

    @staticmethod
    def position(sampler, depth):
        return sampler.position


def chain(sampler):
    """Two drafted tokens, each drawn from q (early exit)."""
    first = sampler.sample(Q0)
    second = sampler.sample(Q1[first])
    draws = [Draw(-1, [first], [0], Q0), Draw(0, [second], [1], Q1[first])]
    return Proposal(tokens=torch.tensor([first, second]), draws=draws)


def tree(sampler):
    """x's children: 3 drawn without replacement, the first two verified; each of those has 2 children drawn
    without replacement, the first verified, the second not (accepting it ends the step)."""
    tokens, parents, draws = [], [], []
    root = sampler.draw(Q0, 3)
    nodes = []
    for token in root[:2]:
        tokens.append(token), parents.append(-1)
        nodes.append(len(tokens) - 1)
    draws.append(Draw(-1, root, nodes + [None], Q0))
    for node in nodes:
        children = sampler.draw(Q1[tokens[node]], 2)
        tokens.append(children[0]), parents.append(node)
        draws.append(Draw(node, children, [len(tokens) - 1, None], Q1[tokens[node]]))
    return Proposal(tokens=torch.tensor(tokens), parents=torch.tensor(parents), draws=draws)


def siblings(sampler):
    """Three children of x drawn without replacement, none verified."""
    drawn = sampler.draw(Q0, 3)
    return Proposal(tokens=torch.empty(0, dtype=torch.long), draws=[Draw(-1, drawn, [None] * 3, Q0)])


def one_hot(sampler):
    """A deterministic chain (prompt lookup): 1 then 2, no draws."""
    return Proposal(tokens=torch.tensor([1, 2]))


def mixed(sampler):
    """Two drawn children of x, then a deterministic one chosen after seeing them (a cascade correction): the
    smallest token not drawn."""
    drawn = sampler.draw(Q0, 2)
    correction = min(set(range(V)) - set(drawn))
    return Proposal(tokens=torch.tensor(drawn + [correction]), parents=torch.tensor([-1, -1, -1]),
                    draws=[Draw(-1, drawn, [0, 1], Q0)])


def emitted_pairs(rule, build, seed: int, trials: int = TRIALS) -> torch.Tensor:
    """Counts ``[V, V]`` of the first two tokens emitted; when a step emits one token, the second comes from plain
    sampling, as the next step's first token would. Trial t emits at sequence positions 2t and 2t + 1."""
    sampler = Sampler(temperature=1.0, seed=seed)
    counts = torch.zeros(V, V, dtype=torch.long)
    for trial in range(trials):
        sampler.position = 2 * trial
        proposal = build(sampler)
        rows = [P0] + [P1[token] for token in proposal.tokens.tolist()]  # rows below depth 1 only decide token 3
        verdict = rule.accept(proposal, torch.stack(rows).log(), sampler)
        out = [int(proposal.tokens[node]) for node in verdict.accepted] + [verdict.next_token]
        if len(out) == 1:
            out.append(sampler.token_at(P1[out[0]], 2 * trial + 1))
        counts[out[0], out[1]] += 1
    return counts


def pvalue(counts: torch.Tensor) -> float:
    return chi2_pvalue(counts.flatten(), (P0[:, None] * P1).flatten())


@pytest.mark.parametrize("build", [chain, tree, siblings, one_hot, mixed])
def test_speculative_sampling_emits_the_target_distribution(build):
    assert pvalue(emitted_pairs(SpeculativeSampling(), build, seed=1)) > 1e-3


@pytest.mark.parametrize("mutant, build", [(NoResidual, chain), (NoResidual, tree), (NoExclusion, siblings),
                                           (NoExclusion, tree), (SamePosition, one_hot)])
def test_the_check_catches_a_broken_rule(mutant, build):
    assert pvalue(emitted_pairs(mutant(), build, seed=1)) < 1e-6


def test_unverified_candidate_ends_the_step():
    # x's draw has a single unverified candidate that the target surely accepts: p(3) = 1 >= q(3)
    logits = torch.full((1, V), float("-inf"))
    logits[0, 3] = 0.0
    proposal = Proposal(tokens=torch.empty(0, dtype=torch.long), draws=[Draw(-1, [3], [None], Q0)])
    verdict = SpeculativeSampling().accept(proposal, logits, Sampler(1.0, seed=0))
    assert verdict.accepted == [] and verdict.next_token == 3 and verdict.next_drafted and verdict.num_accepted == 1


def test_greedy_rule_ignores_the_sampler():
    proposal = Proposal(tokens=torch.tensor([1, 2]))
    logits = torch.zeros(3, 6)
    logits[0, 1] = logits[1, 4] = logits[2, 0] = 1
    verdict = GreedyAcceptance().accept(proposal, logits)
    assert verdict.accepted == [0] and verdict.next_token == 4 and not verdict.next_drafted


# ------------------------------------------------------------------------------------------------ typical acceptance
def probs_rows(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_typical_threshold_by_hand():
    rule = TypicalAcceptance(tau=0.3, alpha=0.5)
    # uniform over 4 tokens: H = ln 4, alpha * exp(-H) = 0.5 / 4 = 0.125 < tau; certain: H = 0, min(0.3, 0.5) = 0.3
    threshold = rule.thresholds(probs_rows([0.25] * 4, [1.0, 0, 0, 0]))
    assert torch.allclose(threshold, torch.tensor([0.125, 0.3], dtype=torch.float64))


def test_typical_chain_keeps_the_accepted_prefix_then_the_targets_token():
    rule = TypicalAcceptance(tau=0.3, alpha=0.5)
    greedy = Sampler()  # temperature 0: the check on the softmax, the next token is the argmax
    # rows: after x, flat over 0..3 (threshold 0.125: token 2 with 0.25 passes); after d1 certain of 1 (threshold
    # 0.3: token 3 with 0 fails); so d1 = 2 is kept, d2 = 3 is not, and the next token is the argmax after d1: 1
    rows = probs_rows([0.25, 0.25, 0.25, 0.25, 0, 0], [0, 1.0, 0, 0, 0, 0], [0, 0, 0, 0, 1.0, 0]).log()
    verdict = rule.accept(Proposal(tokens=torch.tensor([2, 3])), rows, greedy)
    assert verdict.accepted == [0] and verdict.next_token == 1
    assert rule.label == "typical (lossy)" and not rule.lossless


def test_typical_tree_prefers_depth_then_likelihood():
    rule = TypicalAcceptance(tau=0.09, alpha=0.3)
    # x -> n0 (token 0), n1 (token 1); n0 -> n2 (token 4), n1 -> n3 (token 5); all pass; depth ties at 2;
    # the likelihood of n1 -> n3 (0.4 * 0.9) beats n0 -> n2 (0.5 * 0.5)
    parents = torch.tensor([-1, -1, 0, 1])
    rows = probs_rows([0.5, 0.4, 0.1, 0, 0, 0], [0, 0, 0, 0, 0.5, 0.5], [0, 0, 0, 0, 0.1, 0.9],
                      [0.9, 0.1, 0, 0, 0, 0], [0, 0, 0, 1.0, 0, 0]).log()
    verdict = rule.accept(Proposal(tokens=torch.tensor([0, 1, 4, 5]), parents=parents), rows, Sampler())
    assert verdict.accepted == [1, 3] and verdict.next_token == 3
    # sampled: the next token is a sample of the warped target after the path (certain: token 3)
    verdict = rule.accept(Proposal(tokens=torch.tensor([0, 1, 4, 5]), parents=parents), rows, Sampler(0.8, seed=1))
    assert verdict.accepted == [1, 3] and verdict.next_token == 3


def test_rule_selection_and_bad_typical_settings():
    assert isinstance(make_acceptance("exact", 0.0), GreedyAcceptance)
    assert isinstance(make_acceptance("exact", 0.7), SpeculativeSampling)
    typical = make_acceptance("typical", 0.7)
    assert isinstance(typical, TypicalAcceptance) and (typical.tau, typical.alpha) == (0.09, 0.3)
    assert make_acceptance("typical", 0.0, typical_tau=0.2).tau == 0.2
    assert all(make_acceptance(*args).label == "exact" for args in (("exact", 0.0), ("exact", 1.0)))
    with pytest.raises(InvalidArgumentError, match="typical_tau applies to typical acceptance only"):
        make_acceptance("exact", 0.7, typical_tau=0.1)
    with pytest.raises(InvalidArgumentError, match="typical_tau and typical_alpha apply"):
        make_acceptance("exact", 0.0, typical_tau=0.1, typical_alpha=0.2)
    with pytest.raises(InvalidArgumentError, match="acceptance must be one of exact, typical"):
        make_acceptance("soft", 0.7)
    with pytest.raises(InvalidArgumentError, match=r"typical_alpha must lie in \(0, 1\]"):
        make_acceptance("typical", 0.7, typical_alpha=0.0)
