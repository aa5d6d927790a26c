"""Feature drafting (method ``eagle``): lossless against transformers' greedy decoding on every family and tree
shape, drafts really accepted, the adapter's cache holds only true entries, clear errors for wrong adapters."""

from __future__ import annotations

import pytest
import torch

from cats.draft import EarlyExitDrafter
from cats.methods import make_drafter
from cats.model.adapter import AdapterError, load_adapter, new_adapter
from cats.draft.eagle import FeatureDrafter
from cats.errors import InvalidArgumentError
from cats.config import GenerationConfig
from cats.loop.generator import Generator
from cats.methods import memory_needs
from tests.conftest import FAMILIES, VOCAB, hf_greedy, tiny_model
from cats.config import DraftConfig

NEW_TOKENS = 40
SHAPES = [dict(tree_topk=1, total_tokens=5, depth=5), dict(tree_topk=2, total_tokens=6, depth=3),
          dict(tree_topk=4, total_tokens=16, depth=5)]


def feature_adapter(model):
    """An untrained feature adapter made to imitate a damped tiny model: its block is the target's layer 0 and its
    input the next token's embedding, so its estimate of f_{t+1} is close to the target's (often, not always)."""
    adapter = new_adapter(model, "draft", model.num_layers, input="features")
    with torch.no_grad():
        size = model.config.hidden_size
        adapter.fc.weight.zero_()
        adapter.fc.weight[:, size:] = torch.eye(size, dtype=adapter.fc.weight.dtype)
        adapter.block.load_state_dict(model.layers[0].state_dict())
    return adapter.eval().requires_grad_(False)


def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (12,), generator=g).tolist(), torch.randint(3, VOCAB, (8,), generator=g).tolist() * 3,
            [5]]


def run(model, drafter, prompt, **config):
    return Generator(model, drafter).generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, **config))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("damp", [None, 0.1], ids=["random", "damped"])
def test_eagle_equals_hf_greedy_for_every_tree_shape(family, damp):
    model = tiny_model(family, damp=damp)
    adapter = feature_adapter(model)
    accepted = 0
    # random models reject nearly every draft: two prompts and two shapes cover them
    cases = prompts() if damp else prompts()[1:]
    for prompt in cases:
        expected = hf_greedy(model, prompt, NEW_TOKENS)
        for shape in SHAPES if damp else SHAPES[::2]:
            result = run(model, FeatureDrafter(model, adapter, **shape), prompt)
            assert result.token_ids == expected, f"{family} {shape} prompt={prompt[:4]}..."
            stats = result.stats
            assert stats.new_tokens == len(expected) == 1 + sum(stats.accept_lengths)
            accepted += stats.accepted_draft_tokens
    if damp is not None:
        assert accepted > 0, family  # the equality above covered accepted drafts, not only rejections


def test_drafts_are_accepted_and_trees_beat_chains():
    model = tiny_model("llama", damp=0.1)
    adapter = feature_adapter(model)
    prompt = prompts()[0]
    chain = run(model, FeatureDrafter(model, adapter, tree_topk=1, total_tokens=5, depth=5), prompt).stats
    tree = run(model, FeatureDrafter(model, adapter, tree_topk=4, total_tokens=16, depth=5), prompt).stats
    assert 0 < chain.accepted_draft_tokens < chain.drafted_tokens
    assert max(chain.accept_lengths) >= 3  # several drafts in a row, through the adapter's own estimated features
    assert tree.target_forwards <= chain.target_forwards


def test_the_adapter_cache_holds_only_true_entries():
    """After each step the adapter's layer holds exactly the committed positions it has true features for."""
    model = tiny_model("qwen2-swa", damp=0.1)
    drafter = FeatureDrafter(model, feature_adapter(model), tree_topk=2, total_tokens=6, depth=3)
    generator, stats = Generator(model, drafter), None
    from cats.loop.stats import GenerationStats

    stats = GenerationStats()
    prompt = prompts()[0]
    seen = 0
    for _ in generator.stream(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS), stats):
        seen += 1
        if drafter._features is not None and seen > 1:
            assert drafter._fed + drafter._features.shape[0] == len(prompt) + stats.new_tokens - 1
    assert stats.new_tokens == NEW_TOKENS


def test_sampled_eagle_is_reproducible_and_draws_its_drafts():
    model = tiny_model("llama", damp=0.1)
    drafter = FeatureDrafter(model, feature_adapter(model), depth=3)
    config = dict(temperature=0.8, seed=3, ignore_eos=True)
    first, second = run(model, drafter, prompts()[0], **config), run(model, drafter, prompts()[0], **config)
    assert first.token_ids == second.token_ids and len(first.token_ids) == NEW_TOKENS
    assert first.stats.accepted_draft_tokens > 0


def test_adapter_files_and_errors(tmp_path):
    model = tiny_model("llama", damp=0.1)
    folder = feature_adapter(model).save(tmp_path / "adapters" / "feature")
    loaded = load_adapter(folder, model, role="draft", layer=model.num_layers)
    assert loaded.config.input == "features" and loaded.fc is not None
    drafter = make_drafter("eagle", model, DraftConfig(adapters=str(tmp_path / "adapters"), tree_topk=1, depth=4))
    assert isinstance(drafter, FeatureDrafter) and drafter.depth == 4
    expected = hf_greedy(model, prompts()[0], NEW_TOKENS)
    assert run(model, drafter, prompts()[0]).token_ids == expected
    with pytest.raises(InvalidArgumentError, match="needs --adapters"):
        make_drafter("eagle", model)
    with pytest.raises(InvalidArgumentError, match="--depth"):
        make_drafter("eagle", model, DraftConfig(adapters=str(tmp_path / "adapters"), num_draft_tokens=3))
    hidden = new_adapter(model, "draft", 1)
    with pytest.raises(AdapterError, match="feature draft adapter"):
        FeatureDrafter(model, hidden)
    with pytest.raises(AdapterError, match="after all"):
        new_adapter(model, "draft", 2, input="features")
    with pytest.raises(AdapterError, match="role must be 'draft'"):
        new_adapter(model, "shallow", model.num_layers, input="features")
    with pytest.raises(AdapterError, match="outside"):  # a hidden-state adapter cannot sit after the last layer
        new_adapter(model, "draft", model.num_layers)
    with pytest.raises(InvalidArgumentError, match="--method eagle"):
        EarlyExitDrafter(model, adapter=loaded)


def test_memory_needs_keep_no_layer_resident_for_eagle(tmp_path):
    model = tiny_model("llama")
    feature_adapter(model).save(tmp_path / "feature")
    needs = memory_needs(model.config, torch.float32, "eagle", DraftConfig(adapters=str(tmp_path), total_tokens=8))
    assert needs.min_resident_layers == 0 and needs.extra_cache_layers == 1
    assert needs.max_tree_tokens == 9 and needs.adapter_bytes > 0


def test_dytc_schedules_feature_chains_and_trees_losslessly():
    from cats.draft.dytc.scheduler import DraftOption, DyTCDrafter
    from cats.draft.eagle import FeatureDrafterView
    from cats.draft.prompt_lookup import PromptLookupDrafter

    model = tiny_model("llama", damp=0.1)
    core = FeatureDrafter(model, feature_adapter(model))
    drafter = DyTCDrafter([DraftOption("eagle-chain", FeatureDrafterView(core, 1, 4, 4), 4, 0.6, 0.05),
                           DraftOption("eagle", FeatureDrafterView(core, 2, 6, 3), 6, 0.6, 0.05, tree=True)],
                          lookup=PromptLookupDrafter(num_tokens=6), features=core)
    assert drafter.wants_features and drafter.cache_layers == 1
    choices = {}
    for prompt in prompts():
        result = run(model, drafter, prompt)
        assert result.token_ids == hf_greedy(model, prompt, NEW_TOKENS), prompt[:4]
        for key, count in result.stats.scheduler["choices"].items():
            choices[key] = choices.get(key, 0) + count
    assert choices["eagle-chain"] > 0 and choices["eagle"] > 0, choices
