"""Layer skipping: sublayer split, losslessness on every family (plain, prompt-lookup cascade, layer-skip cascade,
trees), the KV-cache contract (every layer holds exactly the target's K/V of the committed tokens at every step), and
trees grown from the skip model's own top-k."""

from __future__ import annotations

import pytest
import torch

from cats.draft import LayerSkipDrafter, PromptLookupDrafter, SkipSet
from cats.draft.base import DecodeState
from cats.draft.layer_skip.drafter import SkipModel, split_layer
from cats.errors import InvalidArgumentError
from cats.config import GenerationConfig
from cats.loop.generator import Generator
from cats.loop.stats import GenerationStats
from tests.conftest import FAMILIES, VOCAB, hf_greedy, tiny_model

NEW_TOKENS = 30


def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (9,), generator=g).tolist(), torch.randint(3, VOCAB, (7,), generator=g).tolist() * 3]


def drafters(model):
    dense, sparse = SkipSet(attention=(2,), mlp=(1, 3)), SkipSet(attention=(1, 2), mlp=(1, 2, 3))
    yield LayerSkipDrafter(model, dense, num_tokens=4)
    yield LayerSkipDrafter(model, dense, num_tokens=6, assist=PromptLookupDrafter(num_tokens=8))
    helper = LayerSkipDrafter(model, sparse, num_tokens=6, assist=PromptLookupDrafter(num_tokens=8))
    yield LayerSkipDrafter(model, SkipSet(mlp=(3,)), num_tokens=5, assist=helper)
    yield LayerSkipDrafter(model, SkipSet(attention=(0, 1, 2, 3)), num_tokens=3, threshold=0.2)  # no attention at all
    yield LayerSkipDrafter(model, dense, num_tokens=5, tree_topk=2, total_tokens=9)
    yield LayerSkipDrafter(model, sparse, num_tokens=4, tree_topk=3, total_tokens=12, threshold=0.05)
    yield LayerSkipDrafter(model, SkipSet(attention=(0, 1, 2, 3)), num_tokens=3, tree_topk=2)  # no attention at all


@pytest.mark.parametrize("family", FAMILIES)
def test_split_sublayers_compose_to_the_decoder_layer(family):
    model = tiny_model(family)
    hidden = torch.randn(1, 6, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(6)
    kind = model.layer_types[1]
    kwargs = dict(attention_mask=model.attention_mask(torch.empty(0, dtype=torch.long), positions, None, kind),
                  position_embeddings=model.rotary(hidden, positions[None], kind), position_ids=positions[None],
                  use_cache=True)
    attention, mlp = split_layer(model.layers[1])
    whole = model.layers[1](hidden, cache=model.new_cache().hf_cache, **kwargs)
    parts = mlp(attention(hidden, cache=model.new_cache().hf_cache, **kwargs))
    assert torch.equal(parts, whole)


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_skip_equals_greedy(family):
    model = tiny_model(family, damp=0.1)
    for prompt in prompts():
        expected = hf_greedy(model, prompt, NEW_TOKENS)
        for drafter in drafters(model):
            result = Generator(model, drafter).generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS))
            assert result.token_ids == expected, (family, drafter.label, prompt[:3])


def test_nothing_skipped_drafts_what_the_target_says():
    """An empty skip set is the target itself: every drafted token is accepted (the accept path is exercised)."""
    model = tiny_model("llama")
    drafter = LayerSkipDrafter(model, SkipSet(), num_tokens=4)
    stats = Generator(model, drafter).generate(prompts()[0], GenerationConfig(max_new_tokens=21)).stats
    assert stats.accepted_draft_tokens == stats.drafted_tokens > 0 and stats.accept_lengths == [5] * 4


def test_assist_saves_skip_model_forwards():
    model = tiny_model("llama", damp=0.1)
    prompt = prompts()[1]
    skip = SkipSet(attention=(2,), mlp=(1, 3))
    plain = LayerSkipDrafter(model, skip, num_tokens=6)
    assisted = LayerSkipDrafter(model, skip, num_tokens=6, assist=PromptLookupDrafter(num_tokens=8))
    first = Generator(model, plain).generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS))
    second = Generator(model, assisted).generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS))
    assert first.stats.accept_lengths == second.stats.accept_lengths  # the same chains: the skip model's greedy ones
    assert assisted.forwards < plain.forwards


@pytest.mark.parametrize("family", ["llama", "qwen2-swa", "gemma3"])
@pytest.mark.parametrize("shape", ["assisted chain", "tree"])
def test_cache_holds_the_targets_kv_at_every_step(family, shape):
    """Before and after every draft, every cache layer holds exactly the committed tokens with the K/V the target
    computes for them (compared with one full forward over the final sequence)."""
    model = tiny_model(family, damp=0.1)
    prompt = prompts()[1]
    if shape == "tree":
        drafter = LayerSkipDrafter(model, SkipSet(attention=(2,), mlp=(1,)), num_tokens=4, tree_topk=3, total_tokens=10)
    else:
        helper = LayerSkipDrafter(model, SkipSet(attention=(1, 2), mlp=(2, 3)), num_tokens=5,
                                  assist=PromptLookupDrafter(num_tokens=6))
        drafter = LayerSkipDrafter(model, SkipSet(attention=(2,), mlp=(1,)), num_tokens=5, assist=helper)
    snapshots = []
    original = drafter.propose

    def recording_propose(state, max_tokens):
        before = _snapshot(state.cache)
        proposal = original(state, max_tokens)
        after = _snapshot(state.cache)
        assert state.cache.lengths() == [state.committed_length] * model.num_layers
        snapshots.extend([(state.committed_length, before), (state.committed_length, after)])
        return proposal

    drafter.propose = recording_propose
    stats = GenerationStats()
    tokens = [t for chunk in Generator(model, drafter).stream(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS),
                                                              stats) for t in chunk]
    reference = model.new_cache()
    model.forward_layers(model.embed(torch.tensor(prompt + tokens)), 0, model.num_layers, reference)
    assert len(snapshots) == 2 * stats.decode_steps > 0
    for length, layers in snapshots:
        for i, (keys, values) in enumerate(layers):
            ref = reference.hf_cache.layers[i]
            assert torch.allclose(keys, ref.keys[..., :length, :], atol=1e-10, rtol=0), (length, i)
            assert torch.allclose(values, ref.values[..., :length, :], atol=1e-10, rtol=0), (length, i)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_tree_holds_the_skip_models_top_k_after_each_expanded_node(family):
    """Every node of a tree with children in it is followed by some of the skip model's top-k tokens after that
    node's own path, computed afresh on the whole sequence (no draft slots, no tree mask): the tree's masks and
    positions give each node the skip model's view of its own path."""
    model = tiny_model(family, damp=0.1)
    skip = SkipSet(attention=(2,), mlp=(1,))
    drafter = LayerSkipDrafter(model, skip, num_tokens=4, tree_topk=3, total_tokens=10)
    prompt = prompts()[0]
    state = _state(model, prompt)
    proposal = drafter.propose(state, 8)
    tokens, parents = proposal.tokens.tolist(), proposal.parents.tolist()
    assert len(tokens) == 10 and proposal.is_tree and proposal.logits is None and proposal.hidden is None
    assert state.cache.lengths() == [len(prompt) - 1] * model.num_layers  # as it was: x stays pending

    def path(node):
        return [] if node < 0 else path(parents[node]) + [tokens[node]]

    def log_probs(sequence):  # the skip model over the whole sequence, from an empty cache
        cache = model.new_cache()
        hidden = SkipModel(model, skip).forward(torch.tensor(sequence), cache, torch.arange(len(sequence)))
        return torch.log_softmax(model.head(hidden[0, -1]).float(), -1)

    reached = set()
    for node in [-1] + list(range(len(tokens))):
        children = [i for i, p in enumerate(parents) if p == node]
        if not children:
            continue
        with torch.inference_mode():
            top = log_probs(prompt + path(node)).topk(3).indices.tolist()
        assert {tokens[i] for i in children} <= set(top), (node, [tokens[i] for i in children], top)
        reached.update(children)
    assert reached == set(range(len(tokens)))  # parents precede their children
    assert all(parents[i] < i for i in range(len(tokens)))
    deepest = max(len(path(i)) for i in range(len(tokens)))
    assert 2 <= deepest <= 4


def _state(model, prompt):
    cache = model.new_cache()
    model.forward_layers(model.embed(torch.tensor(prompt[:-1])), 0, model.num_layers, cache)
    return DecodeState(model, cache, list(prompt), len(prompt))


def _snapshot(cache):
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.hf_cache.layers]


def test_bad_skip_sets_and_assists_are_refused():
    model = tiny_model("llama")
    with pytest.raises(InvalidArgumentError, match=r"attention sublayers \[4\] outside \[0, 4\)"):
        LayerSkipDrafter(model, SkipSet(attention=(4,)))
    with pytest.raises(InvalidArgumentError, match="assisted by prompt lookup or another layer-skip"):
        from cats.draft import EarlyExitDrafter

        LayerSkipDrafter(model, SkipSet(mlp=(1,)), assist=EarlyExitDrafter(model, layer=1))
    with pytest.raises(InvalidArgumentError, match="num_tokens >= 1"):
        LayerSkipDrafter(model, SkipSet(mlp=(1,)), num_tokens=0)
    with pytest.raises(InvalidArgumentError, match="takes no assist"):
        LayerSkipDrafter(model, SkipSet(mlp=(1,)), tree_topk=2, assist=PromptLookupDrafter(num_tokens=4))
    with pytest.raises(InvalidArgumentError, match="tree_topk and total_tokens >= 1"):
        LayerSkipDrafter(model, SkipSet(mlp=(1,)), tree_topk=0)
    skip = SkipSet(attention=(3, 1, 1), mlp=(0,))
    assert skip.attention == (1, 3) and skip.sublayers() == [1, 2, 6] and SkipSet.from_sublayers([1, 2, 6]) == skip
    assert skip.sparsity(4) == 3 / 8 and SkipSet.from_dict(skip.to_dict()) == skip
