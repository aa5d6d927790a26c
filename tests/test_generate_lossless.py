"""Lossless is the contract: every method reproduces transformers' greedy decoding token for token
(tiny random models of every family, float64)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cats.draft import EarlyExitDrafter, PromptLookupDrafter
from cats.config import GenerationConfig
from cats.loop.generator import Generator
from tests.conftest import FAMILIES, VOCAB, hf_greedy, tiny_model

NEW_TOKENS = 40


def prompts():
    g = torch.Generator().manual_seed(7)
    random_prompt = torch.randint(3, VOCAB, (12,), generator=g).tolist()
    repeated = torch.randint(3, VOCAB, (8,), generator=g).tolist() * 3  # gives prompt lookup something to copy
    return [random_prompt, repeated, [5]]


def run(model, drafter, prompt, max_new_tokens=NEW_TOKENS):
    return Generator(model, drafter).generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens))


def drafters(model):
    yield None
    for k in (1, 3, 6):
        yield PromptLookupDrafter(num_tokens=k)
        yield EarlyExitDrafter(model, layer=1, num_tokens=k)
    yield EarlyExitDrafter(model, layer=model.num_layers - 1, num_tokens=4)
    yield PromptLookupDrafter(num_tokens=5, max_ngram=1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("damp", [None, 0.1], ids=["random", "damped"])
def test_every_method_equals_hf_greedy(family, damp):
    model = tiny_model(family, damp=damp)
    for prompt in prompts():
        expected = hf_greedy(model, prompt, NEW_TOKENS)
        for drafter in drafters(model):
            result = run(model, drafter, prompt)
            name = drafter.describe() if drafter else "ar"
            assert result.token_ids == expected, f"{family} {name} prompt={prompt[:4]}..."
            stats = result.stats
            assert stats.new_tokens == len(expected) == 1 + sum(stats.accept_lengths)
            assert stats.target_forwards == 1 + stats.decode_steps


def test_drafts_are_really_accepted_on_damped_model():
    """The lossless tests above must cover partial and full acceptance, not just rejection."""
    model = tiny_model("llama", damp=0.1)
    prompt = prompts()[1]
    early = run(model, EarlyExitDrafter(model, layer=1, num_tokens=4), prompt).stats
    lookup = run(model, PromptLookupDrafter(num_tokens=6), prompt).stats
    assert early.accepted_draft_tokens > 0 and max(early.accept_lengths) == 5
    assert lookup.accepted_draft_tokens > 0
    assert early.decode_steps < NEW_TOKENS - 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=24),
    k=st.integers(1, 8),
    layer=st.integers(1, 3),
    max_new=st.integers(1, 30),
    family=st.sampled_from(["llama", "qwen2-swa", "gemma3"]),
)
def test_property_speculative_equals_plain(prompt, k, layer, max_new, family):
    model = _cached(family)
    expected = run(model, None, prompt, max_new).token_ids
    assert run(model, EarlyExitDrafter(model, layer=layer, num_tokens=k), prompt, max_new).token_ids == expected
    assert run(model, PromptLookupDrafter(num_tokens=k), prompt, max_new).token_ids == expected


_MODELS = {}


def _cached(family):
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family, damp=0.2, seed=3)
    return _MODELS[family]
