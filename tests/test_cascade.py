"""The shallow-verifier cascade: lossless on every family and tree shape, honest counters, cache in step."""

from __future__ import annotations

import pytest
import torch

from cats.verify.cascade import CascadeScorer, ShallowCounts, _ShallowTree
from cats.draft import EarlyExitDrafter, PromptLookupDrafter, TreeDrafter
from cats.model.adapter import new_adapter
from cats.errors import InvalidArgumentError
from cats.config import GenerationConfig
from cats.loop.generator import Generator
from cats.tree import depths
from tests.conftest import FAMILIES, VOCAB, hf_greedy, tiny_model
from cats.config import DraftConfig


def test_counters_on_a_hand_built_case():
    # drafted: x -> {n0 (token 7), n1 (token 8)}, n0 -> n2 (token 9), n1 -> n3 (token 4)
    # the shallow verifier pruned n1 (and so n3), kept n0 and n2, and added a correction c (token 5) after x;
    # the tree the target verifies is [n0, n2, c] (tree indices 0, 1, 2); the target chose 8 after x (so n0 was
    # wrong and the pruned n1 was right), 9 after n0 (n2 right), and anything after n2 and c
    tree = _ShallowTree(tokens=[7, 9, 5], parents=[-1, 0, -1])
    for token, parent, pruned in [(7, -1, False), (8, -1, True), (9, 0, False), (4, None, True)]:
        tree.record(token, parent, pruned)
    model = tiny_model("llama")
    scorer = CascadeScorer(model, new_adapter(model, "shallow", 2))
    target_choice = [8, 9, 3, 3]
    logits = torch.zeros(len(target_choice), VOCAB)
    logits[torch.arange(len(target_choice)), torch.tensor(target_choice)] = 1
    scorer._count(tree, logits, 0.0, 0.0)
    counts = scorer.counts
    assert (counts.true_positive, counts.false_positive, counts.true_negative, counts.false_negative) == (1, 1, 0, 1)
    assert counts.undecided == 1  # n3: its parent n1 was pruned, the target never judged it
    assert (counts.nodes_drafted, counts.nodes_pruned, counts.nodes_verified) == (4, 2, 3)
    assert counts.precision == 0.5 and counts.recall == 0.5 and counts.f1 == 0.5 and counts.keep_rate == 0.5
    data = counts.to_dict()
    assert data["precision"] == 0.5 and data["keep_rate"] == 0.5


def test_empty_counts_do_not_divide_by_zero():
    counts = ShallowCounts()
    assert counts.precision == counts.recall == counts.f1 == counts.keep_rate == 0.0


def drafters(model, shape):
    adapter = new_adapter(model, "draft", 1, vocab_subset=torch.randperm(VOCAB)[:64].tolist())
    if shape == "chain":
        return EarlyExitDrafter(model, num_tokens=4, adapter=adapter)
    if shape == "pld":
        return PromptLookupDrafter(num_tokens=5)
    return TreeDrafter(model, adapter=adapter, tree_topk=3, total_tokens=9, depth=4)


@pytest.mark.parametrize("family", FAMILIES)
def test_cascade_is_lossless(family):
    model = tiny_model(family, damp=0.1)
    torch.manual_seed(1)
    prompt = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(4)).tolist() * 2
    expected = hf_greedy(model, prompt, 32)
    settings = [("tree", 0.05, True, 1), ("chain", 0.0, True, 1), ("pld", 0.05, False, 1),
                ("tree", 0.99, True, 1),  # pruned to empty
                ("tree", 0.05, True, 3), ("chain", 0.2, True, 2), ("chain", 0.0, False, 4)]  # redrafting passes
    for shape, sv_threshold, corrections, sv_passes in settings:
        drafter = drafters(model, shape)
        scorer = CascadeScorer(model, new_adapter(model, "shallow", 3), drafter=None if shape == "pld" else drafter,
                               sv_threshold=sv_threshold, corrections=corrections, sv_passes=sv_passes)
        result = Generator(model, drafter, scorer=scorer).generate(prompt, GenerationConfig(max_new_tokens=32))
        assert result.token_ids == expected, (family, shape, sv_threshold, sv_passes)
        shallow = result.stats.shallow
        assert shallow["steps"] == result.stats.decode_steps
        assert shallow["nodes_drafted"] == result.stats.drafted_tokens + shallow["nodes_redrafted"]
        assert (shallow["redraft_passes"] > 0) == (sv_passes > 1)
        decided = sum(shallow[k] for k in ("true_positive", "false_positive", "true_negative", "false_negative"))
        assert decided + shallow["undecided"] == shallow["nodes_drafted"]
        if sv_threshold == 0.99:
            assert shallow["keep_rate"] < 0.2  # nearly everything pruned, output still exact


@pytest.mark.parametrize("sv_passes", [1, 3])
def test_every_cache_layer_stays_in_step(sv_passes):
    model = tiny_model("gemma3", damp=0.1)
    drafter = drafters(model, "tree")
    scorer = CascadeScorer(model, new_adapter(model, "shallow", 3), drafter=drafter, sv_threshold=0.1,
                           sv_passes=sv_passes)
    original_propose, original_score = drafter.propose, scorer.score

    def checking(state, max_tokens):
        assert state.cache.lengths() == [state.committed_length] * (model.num_layers + 2)
        return original_propose(state, max_tokens)

    def bounded(state, proposal, max_tokens=None):  # redrafted paths stay within the token budget
        verified, logits = original_score(state, proposal, max_tokens)
        if verified.num_tokens:
            assert int(depths(verified.parents).max()) <= max_tokens
        assert logits.shape[0] == verified.num_tokens + 1
        return verified, logits

    drafter.propose, scorer.score = checking, bounded
    result = Generator(model, drafter, scorer=scorer).generate(list(range(5, 30)),
                                                                GenerationConfig(max_new_tokens=30, ignore_eos=True))
    assert len(result.token_ids) == 30 and result.stats.shallow["nodes_pruned"] > 0
    assert (result.stats.shallow["nodes_redrafted"] > 0) == (sv_passes > 1)


def test_bad_cascade_settings():
    model = tiny_model("llama")
    drafter = EarlyExitDrafter(model, layer=2)
    with pytest.raises(InvalidArgumentError, match="must lie above the draft layer"):
        CascadeScorer(model, new_adapter(model, "shallow", 2), drafter=drafter)
    with pytest.raises(InvalidArgumentError, match="sv-threshold"):
        CascadeScorer(model, new_adapter(model, "shallow", 3), sv_threshold=1.0)
    with pytest.raises(InvalidArgumentError, match="sv-passes must be a positive integer"):
        CascadeScorer(model, new_adapter(model, "shallow", 3), drafter=drafter, sv_passes=0)
    with pytest.raises(InvalidArgumentError, match="needs an early-exit or tree drafter"):
        CascadeScorer(model, new_adapter(model, "shallow", 3), sv_passes=2)


def test_sv_passes_belong_to_the_cascade():
    from cats.methods import make_scorer

    model = tiny_model("llama")
    with pytest.raises(InvalidArgumentError, match="sv-passes is a setting of the cascade"):
        make_scorer("tree", model, EarlyExitDrafter(model, layer=2), DraftConfig(sv_passes=2))
