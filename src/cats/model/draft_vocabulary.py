"""The read-out shared by every trained draft head (`cats.model.adapter.Adapter`, `cats.model.eagle3.Eagle3Head`):
the target's own lm_head, or only its rows of a reduced draft vocabulary (the head never stores a copy of them).

A head class mixes `DraftVocabulary` in and sets ``self.target`` (the `LayeredModel`), the buffer ``vocab_ids``
(token ids of the draft vocabulary, most frequent first, or None for all), ``self._head_rows = None`` (the rows
gathered once for decoding: float rows, or for a head on GGUF blocks those rows' blocks) and
``self._train_rows = None`` (the rows made once for training)."""

from __future__ import annotations

import torch
from torch import nn

from cats.model.kernels.gguf_modules import GGUFLinear
from cats.model.kernels.packing import packed_linear
from cats.model.streamed_head import widen


class StoredRows:
    """The rows ``vocab_ids`` of a GGUF lm_head, copied as the file stores them and read out on the same block
    kernels: a Q6_K head's 8,192 rows of 1,536 values take 10 MiB where float32 rows took 48 MiB. Not a module, so
    a head holding it neither registers nor saves it (the rows are the target's, never the adapter's)."""

    def __init__(self, lm_head: GGUFLinear, vocab_ids: torch.Tensor):
        self.linear = lm_head.gathered(vocab_ids)

    def __call__(self, normed: torch.Tensor) -> torch.Tensor:
        return self.linear(normed)


class DraftVocabulary:
    """Logits over the draft vocabulary through the target's lm_head rows, and the maps to and from token ids."""

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (``[..., V_d]``) of normed states ``[..., H]``."""
        lm_head = self.target.hf_model.lm_head  # (its weight read only where needed: on GGUF blocks it is made)
        if self.training:  # the frozen rows, made once per run: on GGUF blocks reading the weight dequantises it
            if self._train_rows is None:
                self._train_rows = (lm_head.weight if self.vocab_ids is None else self.vocabulary_rows()).detach()
            return nn.functional.linear(normed, self._train_rows.to(normed.dtype))
        if self.vocab_ids is None:  # the lm_head module itself: its packed copy when the target packs (one copy)
            return lm_head(normed)
        if isinstance(lm_head, GGUFLinear):  # the rows as the file stores them, on the block kernels
            if not isinstance(self._head_rows, StoredRows):
                self._head_rows = StoredRows(lm_head, self.vocab_ids)
            return self._head_rows(normed)
        if self._head_rows is None or self._head_rows.dtype != normed.dtype:
            # gathered once for decoding: |V_d| rows, the memory price of the reduced vocabulary
            self._head_rows = self.vocabulary_rows().to(normed.dtype)
        if self.target.packed:
            return packed_linear(normed, self._head_rows)
        return nn.functional.linear(normed, self._head_rows)

    def vocabulary_rows(self) -> torch.Tensor:
        """The lm_head's rows of the draft vocabulary ``[V_d, H]`` (a head on GGUF blocks dequantises just those)."""
        lm_head = self.target.hf_model.lm_head
        rows = getattr(lm_head, "dequantized", None)
        if rows is not None:
            return rows(self.vocab_ids.cpu())
        return lm_head.weight.index_select(0, self.vocab_ids.to(lm_head.weight.device))

    def full_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits over the target's whole vocabulary ``[..., V]`` (-inf outside a reduced vocabulary: q = 0 there)."""
        return self.widen(self.logits(normed))

    def widen(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary ``[..., V_d]`` placed in the target's whole vocabulary ``[..., V]``
        (-inf elsewhere); unchanged without a reduced vocabulary."""
        if self.vocab_ids is None:
            return logits
        return widen(logits, self.vocab_ids.to(logits.device), self.target.vocab_size)

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Map indices into the draft vocabulary to token ids."""
        return indices if self.vocab_ids is None else self.vocab_ids.to(indices.device)[indices]
