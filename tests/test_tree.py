"""Token trees: structure helpers, greedy tree acceptance, and lossless tree decoding on every family."""

from __future__ import annotations

import pytest
import torch

from cats.draft import Proposal, TreeDrafter
from cats.model.adapter import new_adapter
from cats.config import GenerationConfig
from cats.loop.generator import Generator
from cats.tree import ancestors, chain_parents, depths, greedy_path, is_chain, verification_attend
from cats.verify.acceptance import GreedyAcceptance
from tests.conftest import FAMILIES, VOCAB, hf_greedy, tiny_model

PARENTS = torch.tensor([-1, -1, 0, 2])  # x -> {n0, n1}, n0 -> n2 -> n3


def test_structure_of_the_docstring_example():
    assert depths(PARENTS).tolist() == [1, 1, 2, 3]
    assert ancestors(PARENTS)[3].tolist() == [True, False, True, True]
    attend = verification_attend(PARENTS, past=2)
    assert attend.shape == (5, 7)
    assert attend[0].tolist() == [True, True, True, False, False, False, False]  # x: prefix + itself
    assert attend[4].tolist() == [True, True, True, True, False, True, True]  # n3: prefix, x, n0, n2, n3
    assert is_chain(chain_parents(3)) and not is_chain(PARENTS)
    with pytest.raises(ValueError, match="topological"):
        depths(torch.tensor([1, -1]))


def test_greedy_path_hand_cases():
    tokens = torch.tensor([7, 8, 9, 4])
    # the target wants 7 after x, 9 after n0, 4 after n2, then 5: the whole branch n0-n2-n3 is accepted
    assert greedy_path(tokens, PARENTS, torch.tensor([7, 9, 0, 4, 5])) == [0, 2, 3]
    # the target wants 8 after x: n1 (a leaf) is accepted, then its own next token
    proposal = Proposal(tokens=tokens, parents=PARENTS)
    logits = torch.zeros(5, 10)
    logits[torch.arange(5), torch.tensor([8, 9, 6, 4, 5])] = 1
    verdict = GreedyAcceptance().accept(proposal, logits)
    assert verdict.accepted == [1] and verdict.next_token == 6
    # nothing matches: no token accepted, the target's token after x
    logits[0] = 0
    logits[0, 3] = 1
    verdict = GreedyAcceptance().accept(proposal, logits)
    assert verdict.accepted == [] and verdict.next_token == 3


SHAPES = {
    "chain": dict(tree_topk=1, total_tokens=5, depth=5),
    "wide": dict(tree_topk=5, total_tokens=12, depth=2),
    "deep": dict(tree_topk=2, total_tokens=12, depth=7),
    "single-node": dict(tree_topk=4, total_tokens=1, depth=4),
    "total-below-depth": dict(tree_topk=3, total_tokens=3, depth=6),
    "threshold": dict(tree_topk=3, total_tokens=10, depth=6, threshold=0.2),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_decoding_equals_hf_greedy(family):
    model = tiny_model(family, damp=0.1)
    torch.manual_seed(0)
    adapters = [None, new_adapter(model, "draft", 1, vocab_subset=torch.randperm(VOCAB)[:64].tolist())]
    prompts = [torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(2)).tolist() * 2, [4]]
    for prompt in prompts:
        expected = hf_greedy(model, prompt, 36)
        for number, (name, shape) in enumerate(SHAPES.items()):
            for adapter in (adapters[number % 2],):  # alternate: half the shapes through an adapter
                drafter = TreeDrafter(model, layer=1 if adapter is not None else 2, adapter=adapter, **shape)
                result = Generator(model, drafter).generate(prompt, GenerationConfig(max_new_tokens=36))
                assert result.token_ids == expected, (family, name, adapter is not None)


def test_tree_keeps_every_cache_layer_in_step():
    model = tiny_model("qwen2-swa", damp=0.1)
    drafter = TreeDrafter(model, layer=1, adapter=new_adapter(model, "draft", 1), tree_topk=3, total_tokens=8, depth=4)
    original, seen = drafter.propose, []

    def checking(state, max_tokens):
        assert state.cache.lengths() == [state.committed_length] * (model.num_layers + 1)
        assert state.cache.positions(0).tolist() == list(range(state.committed_length))
        proposal = original(state, max_tokens)
        lengths = state.cache.lengths()
        assert lengths[:1] == [state.committed_length + 1 + proposal.num_tokens] and lengths[-1] == lengths[0]
        seen.append(proposal)
        return proposal

    drafter.propose = checking
    result = Generator(model, drafter).generate(list(range(5, 25)), GenerationConfig(max_new_tokens=40, ignore_eos=True))
    assert len(result.token_ids) == 40
    assert any(p.is_tree for p in seen)  # real trees were verified, not only chains
    assert all(p.num_tokens <= 8 for p in seen)
