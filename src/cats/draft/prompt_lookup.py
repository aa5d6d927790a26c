"""Prompt lookup decoding: copy the continuation of the latest earlier occurrence of the current n-gram.

Near-free (no model call): it shines where the output repeats the input (summaries, code edits, quotes) or itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cats.draft.base import DecodeState, Drafter, Proposal
from cats.errors import InvalidArgumentError

MATCH_EXTEND = 24  # how far back `lookup_match` measures a match (its length predicts how long the copy holds)


@dataclass
class LookupMatch:
    """What prompt lookup found: the continuation, the n-gram length that matched (0: none) and how many tokens
    back the match actually holds (>= ngram, measured up to `MATCH_EXTEND`)."""

    tokens: np.ndarray
    ngram: int
    length: int


def lookup_continuation(token_ids: np.ndarray, max_ngram: int, min_ngram: int, num_tokens: int) -> np.ndarray:
    """Longest n-gram first (``max_ngram`` down to ``min_ngram``): find the most recent earlier occurrence of the
    last n tokens and return up to ``num_tokens`` tokens that followed it (empty if nothing matches). Where the
    continuation runs into the end of the text and the text is a loop (its last p tokens repeated at least twice
    over, p < ``num_tokens``: small models do fall into them), it is copied on from the draft itself: the tokens
    that followed the earlier occurrence are, from there on, the ones being drafted.

    >>> lookup_continuation(np.array([5, 6, 7, 8, 5, 6]), 2, 1, 3).tolist()
    [7, 8, 5]
    >>> lookup_continuation(np.array([1, 2, 3, 1, 2, 3, 1, 2, 3]), 3, 1, 5).tolist()
    [1, 2, 3, 1, 2]
    >>> lookup_continuation(np.array([1, 2, 3, 1, 2, 3]), 3, 1, 5).tolist()  # one repeat: no loop yet
    [1, 2, 3]
    """
    return lookup_match(token_ids, max_ngram, min_ngram, num_tokens).tokens


def lookup_match(token_ids: np.ndarray, max_ngram: int, min_ngram: int, num_tokens: int,
                 extend: int = MATCH_EXTEND) -> LookupMatch:
    """`lookup_continuation` with the matched n-gram length and the match's full length (up to ``extend``)."""
    length = len(token_ids)
    if length < 2:
        return LookupMatch(token_ids[:0], 0, 0)
    # candidate match ends: earlier positions holding the last token (every one is followed by at least one token)
    ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        matches = ends[ends >= n - 1]
        for back in range(1, n):
            if not matches.size:
                break
            matches = matches[token_ids[matches - back] == token_ids[-1 - back]]
        if matches.size:
            end = int(matches[-1])
            start = end + 1
            found = token_ids[start : start + num_tokens]
            held = n
            limit = min(extend, end + 1)
            while held < limit and token_ids[end - held] == token_ids[-1 - held]:
                held += 1
            period = length - start
            if len(found) < num_tokens and held >= 2 * period:  # a loop (the text repeats its last `period` tokens
                found = np.resize(found, num_tokens)  # at least twice over): the continuation runs on into itself
            return LookupMatch(found, n, held)
    return LookupMatch(token_ids[:0], 0, 0)


class PromptLookupDrafter(Drafter):
    """N-gram copy from prompt + output. Deterministic: no draft logits; under sampling its tokens are one-hot
    candidates (q = e_d)."""

    name = "pld"

    def __init__(self, num_tokens: int = 10, max_ngram: int = 3, min_ngram: int = 1):
        if num_tokens < 1:
            raise InvalidArgumentError(f"prompt lookup needs num_tokens >= 1, got {num_tokens}")
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidArgumentError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram

    def propose(self, state: DecodeState, max_tokens: int) -> Proposal:
        count = min(self.num_tokens, max_tokens)
        if count <= 0:
            return Proposal.empty()
        found = lookup_continuation(np.asarray(state.token_ids), self.max_ngram, self.min_ngram, count)
        return Proposal(tokens=torch.as_tensor(found, dtype=torch.long))

    def describe(self) -> dict:
        return {"name": self.name, "num_tokens": self.num_tokens, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}
