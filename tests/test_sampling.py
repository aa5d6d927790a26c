"""Warping equals transformers' warpers; draws follow their distribution; the same seed gives the same draws;
bad sampling arguments are clear errors."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from cats.errors import InvalidArgumentError
from cats.sampling import Sampler, check_sampling, exclude, warp
from tests.stats_helpers import chi2_pvalue


def hf_warp(logits, temperature, top_p, top_k):
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.3, 0.9, 0), (0.5, 1.0, 5),
                                                       (0.8, 0.6, 12), (1.0, 0.05, 0), (2.0, 1.0, 1)])
def test_warp_equals_transformers(dtype, temperature, top_p, top_k):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3), dtype=dtype) * 3
    logits[0, 7] = float("-inf")  # a token the model rules out (e.g. outside a reduced vocabulary)
    ours = warp(logits, temperature, top_p, top_k)
    assert ours.dtype == dtype and torch.allclose(ours, hf_warp(logits, temperature, top_p, top_k))
    assert torch.allclose(ours.sum(-1), torch.ones(6, dtype=dtype))
    assert float(ours[0, 7]) == 0.0
    if top_k:
        assert int((ours > 0).sum(-1).max()) <= top_k


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert (warp(probs.log(), 1.0, top_p=0.8) > 0).tolist() == [True, True, False, False]
    assert (warp(probs.log(), 1.0, top_p=0.81) > 0).tolist() == [True, True, True, False]
    assert (warp(probs.log(), 1.0, top_p=0.01) > 0).tolist() == [True, False, False, False]


def test_samples_follow_the_distribution_and_never_hit_zero_probability():
    probs = torch.tensor([0.4, 0.0, 0.25, 0.2, 0.1, 0.05, 0.0])
    sampler = Sampler(temperature=1.0, seed=11)
    counts = torch.bincount(torch.tensor([sampler.sample(probs) for _ in range(4000)]), minlength=7)
    assert counts[1] == counts[6] == 0
    assert chi2_pvalue(counts[probs > 0], probs[probs > 0]) > 1e-3


def test_draws_without_replacement_follow_the_sequential_distribution():
    q = torch.tensor([0.5, 0.3, 0.2, 0.0])
    sampler = Sampler(temperature=1.0, seed=5)
    draws = [tuple(sampler.draw(q, 2)) for _ in range(3000)]
    assert all(len(set(d)) == 2 and 3 not in d for d in draws)
    pairs = [(a, b) for a in range(3) for b in range(3) if a != b]
    expected = torch.tensor([float(q[a] * exclude(q, a)[b]) for a, b in pairs])
    counts = torch.tensor([draws.count(pair) for pair in pairs])
    assert chi2_pvalue(counts, expected) > 1e-3
    assert sampler.draw(q, 10) and len(sampler.draw(q, 10)) == 3  # no more tokens than q's support


def test_position_keyed_samples_follow_the_distribution_and_depend_on_seed_and_position_only():
    probs = torch.tensor([0.4, 0.0, 0.25, 0.2, 0.1, 0.05])
    sampler = Sampler(temperature=1.0, seed=3)
    tokens = [sampler.token_at(probs, position) for position in range(3000)]
    counts = torch.bincount(torch.tensor(tokens), minlength=6)
    assert counts[1] == 0 and chi2_pvalue(counts[probs > 0], probs[probs > 0]) > 1e-3
    sampler.sample(probs), sampler.draw(probs, 2)  # other draws do not move the position-keyed noise
    assert [sampler.token_at(probs, position) for position in range(50)] == tokens[:50]
    assert [Sampler(1.0, seed=4).token_at(probs, position) for position in range(50)] != tokens[:50]
    # consecutive positions are independent: pairs follow the product distribution
    pairs = torch.tensor(tokens).view(-1, 2)
    kept = torch.nonzero(probs > 0).flatten()
    joint = torch.zeros(6, 6)
    for a, b in pairs.tolist():
        joint[a, b] += 1
    assert chi2_pvalue(joint[kept][:, kept].flatten(), (probs[kept, None] * probs[None, kept]).flatten()) > 1e-3


def test_same_seed_same_draws_and_greedy_is_argmax():
    logits = torch.randn(40, generator=torch.Generator().manual_seed(0))
    def tokens(seed):
        sampler = Sampler(0.9, top_p=0.9, seed=seed)
        return [sampler.next_token(logits, position) for position in range(20)] + [sampler.sample(sampler.probs(logits))
                                                                                   for _ in range(20)]

    assert tokens(7) == tokens(7) and tokens(7) != tokens(8)
    greedy = Sampler()
    assert greedy.greedy and greedy.next_token(logits, 0) == int(logits.argmax()) and greedy.seed is None
    torch.manual_seed(3)
    drawn = Sampler(1.0).seed
    torch.manual_seed(3)
    assert Sampler(1.0).seed == drawn  # an unseeded run is repeatable under torch.manual_seed
    assert Sampler(0.7, top_k=3, seed=2).describe() == "temperature 0.7, top-k 3, seed 2"


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature must be a number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a number >= 0"),
    (dict(temperature=float("inf")), "temperature must be a number >= 0"),
    (dict(temperature=1.0, top_p=0.0), r"top_p must lie in \(0, 1\]"),
    (dict(temperature=1.0, top_p=1.5), r"top_p must lie in \(0, 1\]"),
    (dict(temperature=1.0, top_k=-1), "top_k must be an integer >= 0"),
    (dict(temperature=1.0, top_k=2.5), "top_k must be an integer >= 0"),
    (dict(temperature=1.0, seed=-3), "seed must be an integer"),
    (dict(temperature=0.0, top_p=0.9), "top_p applies to sampling, but temperature is 0"),
    (dict(temperature=0.0, top_k=5, seed=1), "top_k and seed apply to sampling"),
])
def test_bad_sampling_arguments(kwargs, message):
    arguments = dict(temperature=0.0, top_p=1.0, top_k=0, seed=None) | kwargs
    with pytest.raises(InvalidArgumentError, match=message):
        check_sampling(**arguments)
    with pytest.raises(InvalidArgumentError, match=message):
        Sampler(**arguments)
