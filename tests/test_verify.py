from __future__ import annotations

import torch

from cats.draft import Proposal
from cats.loop.stats import GenerationStats
from cats.verify.acceptance import GreedyAcceptance


def logits_with_argmax(argmaxes, vocab=10):
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 1.0
    return logits


def verdict(drafts, argmaxes):
    proposal = Proposal(tokens=torch.tensor(drafts, dtype=torch.long))
    return GreedyAcceptance().accept(proposal, logits_with_argmax(argmaxes))


def test_worked_example_from_docstring():
    v = verdict([5, 7, 9], [5, 7, 2, 4])
    assert (v.num_accepted, v.next_token) == (2, 2)


def test_all_accepted_takes_bonus_token():
    v = verdict([5, 7, 9], [5, 7, 9, 4])
    assert (v.num_accepted, v.next_token) == (3, 4)


def test_first_rejected_and_later_matches_do_not_count():
    v = verdict([5, 7, 9], [1, 7, 9, 4])
    assert (v.num_accepted, v.next_token) == (0, 1)


def test_empty_proposal_is_plain_decoding():
    v = verdict([], [6])
    assert (v.num_accepted, v.next_token) == (0, 6)


def test_stats_hand_computed():
    stats = GenerationStats(new_tokens=7, drafted_tokens=8, accepted_draft_tokens=3, accept_lengths=[3, 1, 2],
                            wall_s=2.0, target_forwards=4)
    assert stats.decode_steps == 3
    assert stats.mean_accepted == 2.0
    assert stats.acceptance_rate == 3 / 8
    assert stats.tokens_per_s == 3.5
    data = stats.to_dict()
    assert data["mean_accepted"] == 2.0 and data["acceptance_rate"] == 0.375 and data["decode_steps"] == 3
    assert "[ar, acceptance: exact, greedy]" in stats.summary_line()
