"""The preallocated KV cache: growth past its capacity, roll-back, in-place keep and parked slots are exact."""

from __future__ import annotations

import pytest
import torch

from cats.model.cache import KVCache, SlotLayer
from tests.conftest import VOCAB, tiny_model

TOL = 1e-9  # float64


def kv(n: int, start: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.arange(start, start + n, dtype=torch.float64).view(1, 1, n, 1).expand(1, 2, n, 3).contiguous()
    return keys, -keys


def test_slot_layer_grows_crops_and_keeps_in_place():
    layer = SlotLayer(capacity=2)
    keys, values = layer.update(*kv(3))  # past the capacity: the buffer doubles at least
    assert keys.shape == (1, 2, 3, 3) and layer.get_seq_length() == 3
    layer.update(*kv(4, start=3))
    assert layer.keys[0, 0, :, 0].tolist() == list(range(7))
    layer.crop(-2)
    assert layer.get_seq_length() == 5 and layer.keys.shape[-2] == 5
    layer.update(*kv(1, start=50))  # overwrites the stale slot 5
    assert layer.keys[0, 1, :, 0].tolist() == [0, 1, 2, 3, 4, 50]
    layer.keep(torch.tensor([0, 2, 5]))
    assert layer.keys[0, 0, :, 0].tolist() == [0, 2, 50] and layer.values[0, 0, :, 0].tolist() == [0, -2, -50]


def test_slot_layer_views_follow_its_length_and_cannot_be_replaced():
    """keys/values are views of the filled slots made when read; assigning other tensors to them (transformers'
    offload or beam reordering would) is refused instead of being silently lost."""
    layer = SlotLayer(capacity=8)
    assert layer.keys is None and layer.values is None
    layer.update(*kv(5))
    layer.crop(-3)
    assert layer.keys.shape[-2] == 2 and layer.values[0, 0, :, 0].tolist() == [0, -1]
    with pytest.raises(AttributeError, match="views of its buffers"):
        layer.keys = torch.zeros(1, 2, 2, 3)
    with pytest.raises(AttributeError, match="views of its buffers"):
        layer.values = torch.zeros(1, 2, 2, 3)


def test_keep_moves_only_the_slots_after_the_prefix_in_place():
    """`KVCache.keep` of a prefix plus a tree path (the step's roll back) moves the path only; the result equals
    gathering every kept slot, for every layer, and for a layer that holds fewer slots; the positions follow."""
    cache = KVCache(num_layers=2, capacity=16)
    cache.hf_cache.layers[0].update(*kv(10))
    cache.hf_cache.layers[1].update(*kv(8))
    cache.record(0, 1, torch.tensor([0, 1, 2, 3, 4, 5, 6, 6, 7, 8]))  # slots 6 and 7 are siblings
    cache.record(1, 2, torch.tensor([0, 1, 2, 3, 4, 5, 6, 6]))
    moved = []
    original = SlotLayer.keep
    SlotLayer.keep = lambda self, slots, first=0: (moved.append((slots.tolist(), first)), original(self, slots, first))[1]
    try:
        cache.keep(torch.tensor([0, 1, 2, 3, 4, 5, 7, 9]))
    finally:
        SlotLayer.keep = original
    assert moved == [([0, 1, 2, 3, 4, 5, 7, 9], 6), ([0, 1, 2, 3, 4, 5, 7], 6)]
    assert cache.hf_cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 7, 9]
    assert cache.hf_cache.layers[0].values[0, 1, :, 0].tolist() == [0, -1, -2, -3, -4, -5, -7, -9]
    assert cache.hf_cache.layers[1].keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 7]
    assert cache.positions(0).tolist() == [0, 1, 2, 3, 4, 5, 6, 8] and cache.positions(1).tolist() == list(range(6)) + [6]
    cache.keep(torch.tensor([1, 2]), layers=[1])  # nothing in place: every kept slot moves
    assert cache.hf_cache.layers[1].keys[0, 0, :, 0].tolist() == [1, 2] and cache.positions(1).tolist() == [1, 2]


def test_parked_slots_survive_overwrites():
    cache = KVCache(num_layers=2, capacity=8)
    for i in range(2):
        cache.hf_cache.layers[i].update(*kv(6))
    cache.record(0, 2, torch.arange(6))
    parked = cache.split_off(4, [1])
    assert cache.lengths() == [6, 4]
    cache.hf_cache.layers[1].update(*kv(2, start=90))  # another drafter writes the same slots
    cache.record(1, 2, torch.tensor([7, 8]))
    cache.crop(4, [1])
    cache.restore(parked)
    assert cache.lengths() == [6, 6]
    assert cache.hf_cache.layers[1].keys[0, 0, :, 0].tolist() == list(range(6))
    assert cache.positions(1).tolist() == list(range(6))
    cache.check()


@torch.no_grad()
def test_small_capacity_decode_matches_hf():
    model = tiny_model("llama", seed=3)
    ids = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(5))
    reference = model.hf_model(ids.unsqueeze(0)).logits[0]
    cache = KVCache(model.num_layers, capacity=3)  # grows several times
    assert torch.allclose(model.forward(ids[:10], cache), reference[:10], atol=TOL, rtol=0)
    for t in range(10, 30):
        assert torch.allclose(model.forward(ids[t : t + 1], cache)[-1], reference[t], atol=TOL, rtol=0)
    cache.check()
    assert cache.kv_bytes() >= 2 * model.num_layers * 30 * 8
