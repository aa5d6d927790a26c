"""Early exit with an early-exit feature adapter (input ``features+hidden``): the adapter reads the target's final
features of the committed tokens and each token's state after layer L. Lossless against transformers' greedy
decoding on every family, drafts really accepted, only true entries kept in the adapter's cache, clear errors."""

from __future__ import annotations

import pytest
import torch

from cats.draft import EarlyExitDrafter
from cats.methods import make_drafter
from cats.model.adapter import new_adapter
from cats.draft.tree import TreeDrafter
from cats.errors import InvalidArgumentError
from cats.config import GenerationConfig
from cats.loop.generator import Generator
from cats.methods import memory_needs
from cats.loop.stats import GenerationStats
from tests.conftest import FAMILIES, VOCAB, hf_greedy, tiny_model
from cats.config import DraftConfig

NEW_TOKENS = 40


def early_exit_feature_adapter(model, layer: int = 1):
    """An untrained early-exit feature adapter made to imitate a damped tiny model: ``fc`` passes the next token's
    layer-L state through and ignores the feature, the block is the damped last layer (near identity), so its
    estimate of f_{t+1} is close to the target's (often, not always)."""
    adapter = new_adapter(model, "draft", layer, input="features+hidden")
    with torch.no_grad():
        size = model.config.hidden_size
        adapter.fc.weight.zero_()
        adapter.fc.weight[:, size:] = torch.eye(size, dtype=adapter.fc.weight.dtype)
    return adapter.eval().requires_grad_(False)


def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (12,), generator=g).tolist(), torch.randint(3, VOCAB, (6,), generator=g).tolist() * 3]


def run(model, drafter, prompt, **config):
    return Generator(model, drafter).generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, **config))


@pytest.mark.parametrize("family", FAMILIES)
def test_early_exit_with_features_equals_hf_greedy(family):
    model = tiny_model(family, damp=0.1)
    adapter = early_exit_feature_adapter(model)
    accepted = 0
    for prompt, (num_tokens, threshold) in zip(prompts(), ((3, 0.0), (5, 0.3))):
        expected = hf_greedy(model, prompt, NEW_TOKENS)
        drafter = EarlyExitDrafter(model, num_tokens=num_tokens, adapter=adapter, threshold=threshold)
        result = run(model, drafter, prompt)
        assert result.token_ids == expected, f"{family} k={num_tokens} prompt={prompt[:4]}..."
        assert result.stats.new_tokens == 1 + sum(result.stats.accept_lengths)
        accepted += result.stats.accepted_draft_tokens
    assert accepted > 0, family  # the equality above covered accepted drafts, not only rejections


def test_random_model_rejections_stay_lossless():
    model = tiny_model("gemma3")  # undamped: nearly every draft is rejected
    drafter = EarlyExitDrafter(model, num_tokens=4, adapter=early_exit_feature_adapter(model, layer=2))
    for prompt in prompts():
        assert run(model, drafter, prompt).token_ids == hf_greedy(model, prompt, NEW_TOKENS)


def test_the_adapter_cache_holds_only_true_entries():
    """Before each step's drafting the adapter's layer holds exactly the entries built from true features, and
    drafts several tokens in a row through its own estimated features."""
    model = tiny_model("qwen2-swa", damp=0.1)
    drafter = EarlyExitDrafter(model, num_tokens=4, adapter=early_exit_feature_adapter(model))
    stats, prompt, layer = GenerationStats(), prompts()[0], drafter.adapter.cache_layer
    lengths = []
    original = drafter.propose

    def checked(state, max_tokens):
        proposal = original(state, max_tokens)
        lengths.append((state.cache.length(layer), state.committed_length, drafter._fed))
        return proposal

    drafter.propose = checked
    for _ in Generator(model, drafter).stream(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS), stats):
        pass
    assert lengths and all(held == committed == fed for held, committed, fed in lengths), lengths
    assert max(stats.accept_lengths) >= 3


def test_sampled_drafts_are_reproducible_and_accepted():
    model = tiny_model("llama", damp=0.1)
    drafter = EarlyExitDrafter(model, num_tokens=3, adapter=early_exit_feature_adapter(model))
    config = dict(temperature=0.8, seed=5, ignore_eos=True)
    first, second = run(model, drafter, prompts()[0], **config), run(model, drafter, prompts()[0], **config)
    assert first.token_ids == second.token_ids and len(first.token_ids) == NEW_TOKENS
    assert first.stats.accepted_draft_tokens > 0


def test_early_exit_finds_its_own_adapter_and_trees_refuse_it(tmp_path):
    model = tiny_model("llama")
    new_adapter(model, "draft", 2).save(tmp_path / "draft")
    early_exit_feature_adapter(model, layer=1).save(tmp_path / "early-exit")
    drafter = make_drafter("early-exit", model, DraftConfig(adapters=str(tmp_path), num_draft_tokens=3))
    assert drafter.wants_features and drafter.layer == 1 and drafter.describe()["adapter"]["input"] == "features+hidden"
    tree = make_drafter("tree", model, DraftConfig(adapters=str(tmp_path)))
    assert tree.adapter.config.input == "hidden" and tree.layer == 2  # trees keep draft/
    with pytest.raises(InvalidArgumentError, match="method early-exit"):
        TreeDrafter(model, adapter=early_exit_feature_adapter(model))
    plain = make_drafter("early-exit", model, DraftConfig(adapters=str(tmp_path / "draft"), num_draft_tokens=3))
    assert not plain.wants_features and plain.layer == 2
    # memory plans count the adapter each method loads (the early-exit one has fc as well)
    early = memory_needs(model.config, torch.float64, "early-exit", DraftConfig(adapters=str(tmp_path)))
    trees = memory_needs(model.config, torch.float64, "tree", DraftConfig(adapters=str(tmp_path)))
    size = model.config.hidden_size
    assert early.min_resident_layers == 1 and trees.min_resident_layers == 2
    assert early.adapter_bytes - trees.adapter_bytes == (2 * size * size + size) * 8  # fc, float64; same blocks


def test_adapter_drafters_stop_at_the_default_confidence(tmp_path):
    """Left unset, ``threshold`` is `CONFIDENCE_STOP` for the adapter drafters and 0 elsewhere; an explicit 0 turns
    the stop off. A random tiny model's drafts are unconfident (vocabulary 100+, probabilities ~0.01-0.1), so with
    the default stop every step drafts only its first token, and without it the full length: same output."""
    from cats.methods import CONFIDENCE_STOP

    model = tiny_model("llama")
    assert make_drafter("early-exit", model, DraftConfig(draft_layer=1)).threshold == CONFIDENCE_STOP
    assert make_drafter("tree", model, DraftConfig(draft_layer=1)).threshold == CONFIDENCE_STOP
    assert make_drafter("early-exit", model, DraftConfig(draft_layer=1, threshold=0.0)).threshold == 0.0
    assert make_drafter("pld", model) is not None  # no stop there, and no complaint about one
    with pytest.raises(InvalidArgumentError, match="threshold"):
        make_drafter("pld", model, DraftConfig(threshold=0.4))
    prompt = prompts()[0]
    stopping = run(model, make_drafter("early-exit", model, DraftConfig(draft_layer=1, num_draft_tokens=4)), prompt)
    full = run(model, make_drafter("early-exit", model, DraftConfig(draft_layer=1, num_draft_tokens=4, threshold=0.0)), prompt)
    assert stopping.token_ids == full.token_ids == hf_greedy(model, prompt, NEW_TOKENS)
    steps = stopping.stats.target_forwards - 1
    # one token per step (the first is always drafted), none in a last step that has room for one token only
    assert steps - 1 <= stopping.stats.drafted_tokens <= steps
    assert full.stats.drafted_tokens > 3 * (full.stats.target_forwards - 1)
