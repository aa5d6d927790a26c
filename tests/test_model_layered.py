"""The layered forward reproduces the HF model exactly, over any split of layer ranges, crops and tree masks."""

from __future__ import annotations

import pytest
import torch

from cats.errors import UnsupportedArchitectureError
from cats.model import LayeredModel
from tests.conftest import VOCAB, tiny_model

TOL = 1e-9  # float64


def full_logits(model: LayeredModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.hf_model(ids.unsqueeze(0)).logits[0]


@torch.no_grad()
def test_full_forward_matches_hf(family_model):
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(1))  # 40 > sliding window 12
    cache = family_model.new_cache()
    ours = family_model.forward(ids, cache)
    assert torch.allclose(ours, full_logits(family_model, ids), atol=TOL, rtol=0)
    assert cache.lengths() == [40] * family_model.num_layers
    cache.check()


@torch.no_grad()
def test_split_ranges_and_incremental_decode_match_hf(family_model):
    model = family_model
    ids = torch.randint(3, VOCAB, (36,), generator=torch.Generator().manual_seed(2))
    reference = full_logits(model, ids)
    cache = model.new_cache()
    hidden = model.forward_layers(model.embed(ids[:20]), 0, 1, cache)
    hidden = model.forward_layers(hidden, 1, model.num_layers, cache)
    assert torch.allclose(model.head(hidden)[0], reference[:20], atol=TOL, rtol=0)
    for t in range(20, 36):  # one token at a time, through two ranges, past the sliding window
        hidden = model.forward_layers(model.embed(ids[t : t + 1]), 0, 2, cache)
        hidden = model.forward_layers(hidden, 2, model.num_layers, cache)
        assert torch.allclose(model.head(hidden)[0, -1], reference[t], atol=TOL, rtol=0)


@torch.no_grad()
def test_crop_rolls_back_exactly(family_model):
    model = family_model
    ids = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(3))
    reference = full_logits(model, ids)
    cache = model.new_cache()
    model.forward(ids[:20], cache)
    model.forward(torch.randint(3, VOCAB, (6,)), cache)  # a wrong draft ...
    cache.crop(20)  # ... rolled back
    model.forward_layers(model.embed(torch.tensor([5, 6, 7])), 0, 2, cache)  # a shallow draft on 2 layers ...
    cache.crop(20, layers=range(2))  # ... rolled back on those layers only
    assert cache.lengths() == [20] * model.num_layers
    assert torch.allclose(model.forward(ids[20:], cache), reference[20:], atol=TOL, rtol=0)


def tree_attend(parents: list[int], past: int) -> torch.Tensor:
    n = len(parents)
    ancestors = torch.zeros(n, n, dtype=torch.bool)
    for j, p in enumerate(parents):
        ancestors[j, j] = True
        if p >= 0:
            ancestors[j] |= ancestors[p]
    return torch.cat([torch.ones(n, past, dtype=torch.bool), ancestors], dim=1)


@torch.no_grad()
def test_tree_mask_and_keep_positions(family_model):
    """A 6-node tree verified in one forward equals each root-to-leaf path run as a chain; keeping one path's
    slots leaves the cache exactly as if only that path had been decoded."""
    model = family_model
    prefix = torch.randint(3, VOCAB, (16,), generator=torch.Generator().manual_seed(4))
    tree_tokens = torch.tensor([10, 11, 12, 13, 14, 15])
    parents = [-1, 0, 0, 1, 2, 3]  # node 0 is the root (pending token); two branches
    depths = torch.tensor([0, 1, 1, 2, 2, 3])
    cache = model.new_cache()
    model.forward(prefix, cache)
    tree_logits = model.forward(tree_tokens, cache, position_ids=16 + depths, attend=tree_attend(parents, 16))
    for path in ([0, 1, 3, 5], [0, 2, 4]):
        chain = torch.cat([prefix, tree_tokens[path]])
        assert torch.allclose(tree_logits[path], full_logits(model, chain)[16:], atol=TOL, rtol=0)
    path = [0, 1, 3, 5]
    cache.keep(torch.cat([torch.arange(16), 16 + torch.tensor(path)]))
    assert cache.positions(0).tolist() == list(range(20))
    nxt = torch.tensor([42, 43])
    chain = torch.cat([prefix, tree_tokens[path], nxt])
    assert torch.allclose(model.forward(nxt, cache), full_logits(model, chain)[20:], atol=TOL, rtol=0)


def test_unsupported_architecture_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedArchitectureError, match=r"'gpt2'.*Llama.*Mistral.*Qwen2.*Qwen3.*Gemma3.*Phi3"):
        LayeredModel(hf_model)


def test_layer_range_and_attend_shape_are_checked():
    model = tiny_model("llama")
    cache = model.new_cache()
    with pytest.raises(ValueError, match="outside"):
        model.forward_layers(model.embed(torch.tensor([3])), 0, 9, cache)
    with pytest.raises(ValueError, match="attend must be"):
        model.forward(torch.tensor([3, 4]), cache, attend=torch.ones(2, 3, dtype=torch.bool))
