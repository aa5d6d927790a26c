"""The one KV cache shared by the target and every virtual draft model.

It wraps a transformers ``DynamicCache`` whose layers are all plain ``DynamicLayer`` objects (full history,
also for sliding-window attention: the window is applied by the attention mask, so a rollback is always
exact), and tracks the position id of every cache slot, which masks need once tree nodes share positions.

Invariants (every caller relies on them; ``check()`` asserts the first two):

1. Layer ``i`` holds K/V for ``length(i)`` slots. Layers may differ in length only by a suffix: slot ``j`` holds
   the same token in every layer that has slot ``j`` (a shallow draft writes layers ``[0, L_d)`` ahead of the rest).
2. ``positions(i)[j]`` is the position id of the token in slot ``j`` of layer ``i``.
3. Between two decode steps every layer holds exactly the committed tokens except the last one (that pending
   token is the first input of the next step), in order, so slot ``j`` holds position ``j``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class KVCache:
    """Per-layer K/V storage with crop (roll back) and keep (select tree positions) operations."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.hf_cache = DynamicCache()
        self.hf_cache.layers = [DynamicLayer() for _ in range(num_layers)]
        self._positions: list[torch.Tensor] = [torch.empty(0, dtype=torch.long) for _ in range(num_layers)]

    # ---------------------------------------------------------------- reading
    def length(self, layer: int = 0) -> int:
        """Number of slots held by ``layer``."""
        return self._positions[layer].numel()

    def positions(self, layer: int = 0) -> torch.Tensor:
        """Position ids of ``layer``'s slots, shape ``[length(layer)]``."""
        return self._positions[layer]

    def lengths(self) -> list[int]:
        return [p.numel() for p in self._positions]

    def _layers(self, layers: Iterable[int] | None) -> Iterable[int]:
        return range(self.num_layers) if layers is None else layers

    # ---------------------------------------------------------------- writing
    def record(self, start: int, end: int, position_ids: torch.Tensor) -> None:
        """Note that layers ``[start, end)`` appended slots with these position ids (``[T]``).

        Called by the layered forward after the HF modules have appended their K/V."""
        for i in range(start, end):
            self._positions[i] = torch.cat([self._positions[i], position_ids])

    def crop(self, length: int, layers: Iterable[int] | None = None) -> None:
        """Roll ``layers`` (default: all) back to their first ``length`` slots; shorter layers are untouched."""
        for i in self._layers(layers):
            extra = self.length(i) - length
            if extra > 0:
                self.hf_cache.layers[i].crop(-extra)  # transformers 5.x: a negative count removes from the end
                self._positions[i] = self._positions[i][:length]

    def keep(self, slots: torch.Tensor, layers: Iterable[int] | None = None) -> None:
        """Keep only the given slots (ascending ``LongTensor``), e.g. the prefix plus an accepted tree path."""
        for i in self._layers(layers):
            if self.length(i) == 0:
                continue
            layer = self.hf_cache.layers[i]
            index = slots.to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)
            self._positions[i] = self._positions[i].index_select(0, slots.cpu())

    def split_off(self, length: int, layers: Iterable[int]) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Remove the slots after the first ``length`` of ``layers`` and return them (keys, values, positions per
        layer) for `restore`: a drafter parks its own draft slots while another drafter uses the same layers."""
        parked = []
        for i in layers:
            extra = self.length(i) - length
            if extra > 0:
                layer = self.hf_cache.layers[i]
                parked.append((i, layer.keys[..., length:, :], layer.values[..., length:, :], self._positions[i][length:]))
                self.crop(length, [i])
        return parked

    def restore(self, parked: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Append slots removed by `split_off` back onto their layers."""
        for i, keys, values, positions in parked:
            layer = self.hf_cache.layers[i]
            layer.keys = torch.cat([layer.keys, keys], dim=-2)
            layer.values = torch.cat([layer.values, values], dim=-2)
            self._positions[i] = torch.cat([self._positions[i], positions])

    def check(self) -> None:
        """Assert invariants 1-2 (slot counts agree between K/V tensors and position records)."""
        for i, layer in enumerate(self.hf_cache.layers):
            held = layer.get_seq_length()
            assert held == self.length(i), f"layer {i}: {held} K/V slots but {self.length(i)} positions recorded"

    def __repr__(self) -> str:
        lengths = self.lengths()
        return f"KVCache(num_layers={self.num_layers}, lengths={lengths if len(set(lengths)) > 1 else lengths[0]})"
