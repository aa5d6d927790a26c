from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cats.draft import DecodeState, PromptLookupDrafter
from cats.draft.prompt_lookup import lookup_continuation, lookup_match
from cats.errors import InvalidArgumentError


def lookup(ids, max_ngram=3, min_ngram=1, k=4):
    return lookup_continuation(np.array(ids), max_ngram, min_ngram, k).tolist()


def test_longest_ngram_wins_and_most_recent_match_is_used():
    # trigram [1, 2, 3] occurs at 0; bigram [2, 3] also at 5 (more recent) - the trigram match is preferred
    assert lookup([1, 2, 3, 4, 9, 2, 3, 7, 1, 2, 3]) == [4, 9, 2, 3]
    # only unigram matches: the most recent earlier occurrence of 3
    assert lookup([3, 5, 3, 6, 3], max_ngram=3) == [6, 3]  # "3 6 3" is not a loop (twice over needs "3 6 3 6 3")
    assert lookup([3, 5, 3, 6, 3], max_ngram=3, k=1) == [6]


def test_no_match_gives_empty_and_min_ngram_is_respected():
    assert lookup([1, 2, 3, 4]) == []
    assert lookup([7, 1, 8, 7], min_ngram=2) == []
    assert lookup([7]) == []


@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.integers(1, 4), st.integers(1, 8))
def test_proposal_is_a_real_continuation(ids, max_ngram, k):
    found = lookup(ids, max_ngram=max_ngram, k=k)
    assert len(found) <= k
    if found:  # some earlier occurrence of the last n >= 1 tokens is followed by exactly these tokens, in the text
        # with the draft appended (a loop's continuation runs on into the draft itself)
        text = ids + found
        n_ok = any(
            ids[s : s + n] == ids[-n:] and text[s + n : s + n + len(found)] == found
            for n in range(1, max_ngram + 1)
            for s in range(0, len(ids) - n)
        )
        assert n_ok


def test_loops_are_copied_on_and_matches_are_measured():
    # the last 3 tokens repeat twice over: a loop, copied on past the end of the text
    assert lookup([9, 1, 2, 3, 1, 2, 3, 1, 2, 3], k=7) == [1, 2, 3, 1, 2, 3, 1]
    assert lookup([9, 1, 2, 3, 1, 2, 3], k=7) == [1, 2, 3]  # repeated once only: not yet a loop
    match = lookup_match(np.array([4, 1, 2, 3, 8, 4, 1, 2, 3]), 3, 1, 2)
    assert match.tokens.tolist() == [8, 4] and match.ngram == 3 and match.length == 4  # 4 1 2 3 holds
    assert lookup_match(np.array([1, 2, 3]), 3, 1, 2).length == 0


def test_drafter_respects_budget_and_validates():
    state = DecodeState(model=None, cache=None, token_ids=[1, 2, 3, 1, 2, 3, 1, 2], prompt_length=8)
    drafter = PromptLookupDrafter(num_tokens=10)
    assert drafter.propose(state, max_tokens=2).tokens.tolist() == [3, 1]
    assert drafter.propose(state, max_tokens=0).num_tokens == 0
    proposal = drafter.propose(state, max_tokens=10)
    assert proposal.tokens.dtype == torch.long and proposal.logits is None and proposal.hidden is None
    with pytest.raises(InvalidArgumentError):
        PromptLookupDrafter(num_tokens=0)
    with pytest.raises(InvalidArgumentError):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)
