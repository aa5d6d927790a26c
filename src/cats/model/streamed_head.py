"""The lm_head of a GGUF model streamed under a memory plan, and the rows of it a skip draft reads out through.

On Qwen2.5-Coder-1.5B the lm_head (151,936 rows of Q6_K, 183 MiB) is as large as six decoder layers. A skip draft
under a budget (`cats.draft.layer_skip`, the layers of the model's stream order streamed and skipped) reads the head
for every draft token, but it drafts nearly as well from the rows of the lowest token ids (byte-level BPE numbers
its tokens in merge order, the most frequent first: ids below 32,768 are 93-95 % of Qwen2.5-Coder's greedy answer
tokens), and more resident layers make it agree more. So where the planner finds it pays
(`cats.model.weights.skip_rate.skip_draft_rate`), the head streams like a layer: its rows past the draft's, after the
last decoder layer, in pieces of one stream buffer each, read by the same reader in the same sweep (`LayerStreamer`,
units numbered after the layers). The draft's rows stay resident as the file stores them, on the same block kernels,
and verification reads them there. The output is unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from cats.model.kernels.gguf_modules import GGUFLinear
from cats.model.weights.budget import END_ROWS

DRAFT_VOCABULARY = 32768  # rows a skip draft reads out through while the head streams (at most a quarter of the
# vocabulary)


def draft_vocabulary_size(vocab_size: int) -> int:
    """Rows of the draft vocabulary's leading ids for a vocabulary of ``vocab_size`` tokens."""
    return min(DRAFT_VOCABULARY, vocab_size // 4)


def draft_vocabulary(vocab_size: int, eos_ids) -> torch.Tensor:
    """The token ids a skip draft proposes while the head streams: the lowest ``draft_vocabulary_size`` ids, then up
    to `END_ROWS` end-of-sequence ids above them, ascending."""
    count = draft_vocabulary_size(vocab_size)
    extra = sorted({int(i) for i in eos_ids if count <= int(i) < vocab_size})[:END_ROWS]
    return torch.tensor(list(range(count)) + extra, dtype=torch.long)


class StreamedHead(nn.Module):
    """The lm_head with its leading rows resident (``resident``: rows ``[0, n)``, the draft rows' own copy) and the
    others read piece by piece through a `LayerStreamer`: piece j holds the next rows and is the streamer's unit
    ``first_unit + j``. Each logit is its row's dot product whichever part holds the row (the block kernels compute
    every output row on its own), so the logits are the whole head's, bit for bit. The pieces are not registered
    (their parameters are meta between uses)."""

    def __init__(self, resident: GGUFLinear, pieces: list[GGUFLinear], first_unit: int):
        super().__init__()
        self.resident, self.pieces, self.first_unit = resident, pieces, first_unit
        self.in_features = resident.in_features
        self.out_features = resident.out_features + sum(piece.out_features for piece in pieces)
        self.streamer = None  # set once the streamer exists

    @property
    def units(self) -> list[int]:
        return [self.first_unit + j for j in range(len(self.pieces))]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = [self.resident(hidden)]
        for unit, piece in zip(self.units, self.pieces):
            self.streamer.acquire(unit)
            try:
                out.append(piece(hidden))
            finally:
                self.streamer.release(unit)
        return torch.cat(out, dim=-1)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"resident_rows={self.resident.out_features}, pieces={len(self.pieces)}")


class DraftRows(nn.Module):
    """The lm_head's rows of ``vocab_ids`` as the file stores them (a copy of just those rows), reading out logits
    over the whole vocabulary: -inf for every token outside the draft vocabulary."""

    def __init__(self, rows: GGUFLinear, vocab_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        self.rows, self.vocab_size = rows, vocab_size
        self.register_buffer("vocab_ids", vocab_ids, persistent=False)

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        return widen(self.rows(normed), self.vocab_ids, self.vocab_size)


def widen(logits: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over a draft vocabulary (``[..., V_d]``, token ids ``vocab_ids``) placed in the whole vocabulary
    (``[..., V]``): -inf for every other token."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, vocab_ids, logits)


def head_pieces(head: GGUFLinear, start: int, rows_per_piece: int) -> list[GGUFLinear]:
    """``head``'s rows from ``start`` on, in pieces of ``rows_per_piece``, each on the meta device (the streamer binds
    its rows)."""
    rows, row_bytes = head.blocks.shape
    return [GGUFLinear(torch.empty((min(rows_per_piece, rows - first), row_bytes), dtype=head.blocks.dtype,
                                   device="meta"), head.type_code, head.columns)
            for first in range(start, rows, rows_per_piece)]


def draft_rows(head: GGUFLinear, vocab_ids: torch.Tensor) -> DraftRows:
    """A copy of ``head``'s rows of ``vocab_ids``, kept as stored (its leading rows serve the `StreamedHead` too)."""
    return DraftRows(head.gathered(vocab_ids), vocab_ids, head.out_features)
