"""The one KV cache shared by the target and every virtual draft model.

Every layer's K/V live in preallocated buffers (`SlotLayer`, a transformers cache layer): HF attention's
``cache.update`` copies the new tokens' K/V into the next free slots and attends to a view of the filled prefix,
so a decode step appends without re-copying the history (a ``DynamicLayer`` ``torch.cat``s all of it, O(context)
per step and layer). Buffers are sized to the planned context when it is known (``capacity``) and double when
a step needs more. Sliding-window attention keeps the full history too: the window is applied by the attention
mask, so a rollback is always exact. The cache also tracks the position id of every slot, which masks need once
tree nodes share positions.

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
from transformers.cache_utils import CacheLayerMixin

DEFAULT_CAPACITY = 256  # slots allocated on a layer's first write when no capacity was planned


def _grown(buffer: torch.Tensor, filled: int, needed: int, dim: int) -> torch.Tensor:
    """``buffer`` if it has room for ``needed`` entries along ``dim``, else a larger one (at least double) holding
    its first ``filled`` entries."""
    size = buffer.shape[dim]
    if needed <= size:
        return buffer
    shape = list(buffer.shape)
    shape[dim] = max(needed, 2 * size)
    bigger = buffer.new_empty(shape)
    bigger.narrow(dim, 0, filled).copy_(buffer.narrow(dim, 0, filled))
    return bigger


def _only_none(value) -> None:
    """transformers' cache layer sets ``keys``/``values`` to None when made; a `SlotLayer` derives them from its
    buffers and length, so any other assignment would be lost: refuse it."""
    if value is not None:
        raise AttributeError("a SlotLayer's keys/values are views of its buffers: write slots with update(), "
                             "shorten with crop()")


class SlotLayer(CacheLayerMixin):
    """One decoder layer's K/V in preallocated ``[B, heads, capacity, head_dim]`` buffers; ``keys``/``values`` are
    views of the first ``length`` slots. Roll back = shorten; writes go to slot ``length`` onwards."""

    is_sliding = False
    is_croppable = True

    def __init__(self, capacity: int | None = None):
        super().__init__()
        self.capacity = capacity or DEFAULT_CAPACITY
        self.length = 0
        self._keys = self._values = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        batch, heads, _, dim = key_states.shape
        self._keys = key_states.new_empty((batch, heads, self.capacity, dim))
        self._values = value_states.new_empty((batch, value_states.shape[1], self.capacity, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new K/V to slots ``length ..`` and return views of all filled slots (what attention reads)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        self._keys = _grown(self._keys, start, end, -2)
        self._values = _grown(self._values, start, end, -2)
        self._keys[:, :, start:end].copy_(key_states)
        self._values[:, :, start:end].copy_(value_states)
        self._set_length(end)
        return self.keys, self.values

    def reserve(self, count: int, heads: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for ``count`` more slots: ``(keys buffer, values buffer, first free slot)``, the buffers
        ``[1, heads, capacity, dim]`` (allocated or grown as `update` would); the caller writes the slots and then
        sets the length (``_set_length``)."""
        if not self.is_initialized:
            self.lazy_initialization(torch.empty(1, heads, 0, dim, dtype=dtype), torch.empty(1, heads, 0, dim, dtype=dtype))
        start = self.length
        self._keys = _grown(self._keys, start, start + count, -2)
        self._values = _grown(self._values, start, start + count, -2)
        return self._keys, self._values, start

    def _set_length(self, length: int) -> None:
        self.length = length

    def _filled(self, buffer: torch.Tensor | None) -> torch.Tensor | None:
        return None if buffer is None else buffer[:, :, :self.length]

    # ``keys``/``values``: views of the filled slots, made when read (a view costs ~4 us, and the whole-layer kernel
    # never reads them: made on every length change they cost ~0.2 ms a Qwen2.5-1.5B decode step)
    keys = property(lambda self: self._filled(self._keys), lambda self, value: _only_none(value))
    values = property(lambda self: self._filled(self._values), lambda self, value: _only_none(value))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._set_length(0)

    def crop(self, tokens_to_remove: int) -> None:
        """transformers 5.x semantics: a negative count removes that many slots from the end."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of slots to remove, got {tokens_to_remove}")
        self._set_length(max(0, self.length + tokens_to_remove))

    def keep(self, slots: torch.Tensor, first: int = 0) -> None:
        """Move the given slots (ascending) to the front, in place, and keep only them; the first ``first`` of them
        are already in place (slot i is slots[i]), so only the rest move: a step that keeps the prefix and an
        accepted path copies the path, not the whole context."""
        if self._keys is None:
            return
        count = slots.numel()
        if first < count:
            index = slots[first:].to(self._keys.device)
            self._keys[:, :, first:count] = self._keys.index_select(-2, index)  # index_select copies: no aliasing
            self._values[:, :, first:count] = self._values.index_select(-2, index)
        self._set_length(count)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ready K/V (``[B, heads, n, head_dim]``) behind the filled slots."""
        self.update(keys, values)


class KVCache:
    """Per-layer K/V storage with crop (roll back) and keep (select tree positions) operations.

    ``capacity``: slots to preallocate per layer (e.g. prompt + new tokens + the largest draft); more are
    allocated (doubling) if a step needs them."""

    def __init__(self, num_layers: int, capacity: int | None = None):
        self.num_layers = num_layers
        self.hf_cache = DynamicCache()
        self.hf_cache.layers = [SlotLayer(capacity) for _ in range(num_layers)]
        initial = capacity or DEFAULT_CAPACITY
        self._positions = torch.empty(num_layers, initial, dtype=torch.long)  # row i: layer i's slots' position ids
        self._lengths = [0] * num_layers

    # ---------------------------------------------------------------- reading
    def length(self, layer: int = 0) -> int:
        """Number of slots held by ``layer``."""
        return self._lengths[layer]

    def positions(self, layer: int = 0) -> torch.Tensor:
        """Position ids of ``layer``'s slots, shape ``[length(layer)]`` (a view: valid until the cache changes)."""
        return self._positions[layer, : self._lengths[layer]]

    def lengths(self) -> list[int]:
        return list(self._lengths)

    def _layers(self, layers: Iterable[int] | None) -> Iterable[int]:
        return range(self.num_layers) if layers is None else layers

    # ---------------------------------------------------------------- writing
    def record(self, start: int, end: int, position_ids: torch.Tensor) -> None:
        """Note that layers ``[start, end)`` appended slots with these position ids (``[T]``).

        Called by the layered forward after the HF modules have appended their K/V."""
        count = position_ids.numel()
        olds = self._lengths[start:end]
        self._positions = _grown(self._positions, max(self._lengths), max(olds) + count, 1)
        if len(set(olds)) == 1:  # a forward's layers (the usual case): one write for all of them
            self._positions[start:end, olds[0]: olds[0] + count] = position_ids
        else:
            for i, old in zip(range(start, end), olds):
                self._positions[i, old: old + count] = position_ids
        self._lengths[start:end] = [old + count for old in olds]

    def crop(self, length: int, layers: Iterable[int] | None = None) -> None:
        """Roll ``layers`` (default: all) back to their first ``length`` slots; shorter layers are untouched."""
        for i in self._layers(layers):
            extra = self._lengths[i] - length
            if extra > 0:
                self.hf_cache.layers[i].crop(-extra)
                self._lengths[i] = length

    def keep(self, slots: torch.Tensor, layers: Iterable[int] | None = None) -> None:
        """Keep only the given slots (ascending ``LongTensor``), e.g. the prefix plus an accepted tree path; a layer
        keeps those of them it holds (a drafter's own layer may hold fewer slots than the target's)."""
        slots = slots.cpu()
        moved = (slots != torch.arange(slots.numel())).nonzero()
        in_place = int(moved[0]) if moved.numel() else slots.numel()  # leading slots that stay where they are
        for i in self._layers(layers):
            length = self._lengths[i]
            if length == 0:
                continue
            held = slots if not slots.numel() or int(slots[-1]) < length else slots[slots < length]
            first = min(in_place, held.numel())
            self.hf_cache.layers[i].keep(held, first)
            buffer = self._positions[i]
            buffer[first: held.numel()] = buffer.index_select(0, held[first:])
            self._lengths[i] = held.numel()

    def split_off(self, length: int, layers: Iterable[int]) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Remove the slots after the first ``length`` of ``layers`` and return copies of them (keys, values,
        positions per layer) for `restore`: a drafter parks its own draft slots while another drafter uses the
        same layers."""
        parked = []
        for i in layers:
            extra = self._lengths[i] - length
            if extra > 0:
                layer = self.hf_cache.layers[i]
                parked.append((i, layer.keys[:, :, length:].clone(), layer.values[:, :, length:].clone(),
                               self.positions(i)[length:].clone()))
                self.crop(length, [i])
        return parked

    def restore(self, parked: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Append slots removed by `split_off` back onto their layers."""
        for i, keys, values, positions in parked:
            self.hf_cache.layers[i].append(keys, values)
            self.record(i, i + 1, positions)

    def kv_bytes(self) -> int:
        """Bytes allocated for K/V (the preallocated buffers, filled or not)."""
        return sum(layer._keys.nbytes + layer._values.nbytes for layer in self.hf_cache.layers
                   if layer._keys is not None)

    def check(self) -> None:
        """Assert invariants 1-2 (slot counts agree between K/V tensors and position records)."""
        for i, layer in enumerate(self.hf_cache.layers):
            held = layer.get_seq_length()
            assert held == self.length(i), f"layer {i}: {held} K/V slots but {self.length(i)} positions recorded"
            if layer.is_initialized:
                assert layer.keys.shape[-2] == held, f"layer {i}: keys view has {layer.keys.shape[-2]} slots, not {held}"

    def __repr__(self) -> str:
        lengths = self.lengths()
        return f"KVCache(num_layers={self.num_layers}, lengths={lengths if len(set(lengths)) > 1 else lengths[0]})"
