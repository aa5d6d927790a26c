"""Prompt lookup decoding: copy the continuation of the latest earlier occurrence of the current n-gram.

Near-free (no model call): it shines where the output repeats the input (summaries, code edits, quotes) or itself.
"""

from __future__ import annotations

import numpy as np
import torch

from cats.draft.base import DecodeState, Drafter, Proposal
from cats.errors import InvalidArgumentError


def lookup_continuation(token_ids: np.ndarray, max_ngram: int, min_ngram: int, num_tokens: int) -> np.ndarray:
    """Longest n-gram first (``max_ngram`` down to ``min_ngram``): find the most recent earlier occurrence of the
    last n tokens and return up to ``num_tokens`` tokens that followed it (empty if nothing matches).

    >>> lookup_continuation(np.array([5, 6, 7, 8, 5, 6]), 2, 1, 3).tolist()
    [7, 8, 5]
    """
    return lookup_with_ngram(token_ids, max_ngram, min_ngram, num_tokens)[0]


def lookup_with_ngram(token_ids: np.ndarray, max_ngram: int, min_ngram: int, num_tokens: int) -> tuple[np.ndarray, int]:
    """`lookup_continuation` and the length n of the n-gram that matched (0 when nothing matched)."""
    length = len(token_ids)
    if length < 2:
        return token_ids[:0], 0
    # candidate match ends: earlier positions holding the last token (every one is followed by at least one token)
    ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        matches = ends[ends >= n - 1]
        for back in range(1, n):
            if not matches.size:
                break
            matches = matches[token_ids[matches - back] == token_ids[-1 - back]]
        if matches.size:
            start = int(matches[-1]) + 1
            return token_ids[start : start + num_tokens], n
    return token_ids[:0], 0


class PromptLookupDrafter(Drafter):
    """N-gram copy from prompt + output. Deterministic: its q is one-hot, so ``Proposal.logits`` is None."""

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
