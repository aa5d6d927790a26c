"""Token recycling (method ``recycle``): the template tree, the table, losslessness on every family (greedy and
sampled), and clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cats.methods import make_drafter
from cats.draft.base import DecodeState, Proposal
from cats.draft.recycle import TokenRecyclingDrafter, TreeTemplate, graft
from cats.errors import InvalidArgumentError
from cats.config import GenerationConfig
from cats.loop.generator import Generator
from cats.methods import memory_needs
from tests.conftest import FAMILIES, VOCAB, hf_greedy, tiny_model
from cats.config import DraftConfig

NEW_TOKENS = 40


def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (10,), generator=g).tolist(), torch.randint(3, VOCAB, (5,), generator=g).tolist() * 4]


def test_template_takes_the_most_probable_rank_paths_breadth_first():
    template = TreeTemplate(total_tokens=3, depth=2, candidates=2, rank_prior=(0.6, 0.3))
    # probabilities: (0,) 0.6, (0, 0) 0.36, (1,) 0.3, then (0, 1) and (1, 0) 0.18
    assert template.paths == [(0,), (1,), (0, 0)]
    assert template.parents == [-1, -1, 0] and template.ranks == [0, 1, 0] and template.depth == 2
    deep = TreeTemplate(total_tokens=16, depth=6)
    assert len(deep.paths) == 16 and max(map(len, deep.paths)) <= 6
    assert all(path[:-1] in deep.paths for path in deep.paths if len(path) > 1)  # ancestor-closed
    assert deep.depths == sorted(deep.depths)  # breadth-first
    with pytest.raises(InvalidArgumentError, match="candidates"):
        TreeTemplate(candidates=20)


def test_proposal_reads_the_table_along_the_template():
    model = tiny_model("llama")
    drafter = TokenRecyclingDrafter(VOCAB, total_tokens=3, depth=2, candidates=2)
    drafter.template = TreeTemplate(total_tokens=3, depth=2, candidates=2, rank_prior=(0.6, 0.3))
    state = DecodeState(model, model.new_cache(), [1, 2, 7], 2)
    assert drafter.propose(state, 4).num_tokens == 0  # empty table: nothing to draft
    drafter.table[7] = [11, 12]
    drafter.table[11] = [13, -1]
    proposal = drafter.propose(state, 4)
    assert proposal.tokens.tolist() == [11, 12, 13] and proposal.parents.tolist() == [-1, -1, 0]
    assert drafter.propose(state, 1).tokens.tolist() == [11, 12]  # the budget limits the depth
    drafter.table[7] = [-1, 12]  # a left-out node takes its subtree with it
    assert drafter.propose(state, 4).tokens.tolist() == [12]


def test_verified_rows_refresh_the_table():
    drafter = TokenRecyclingDrafter(VOCAB, candidates=3)
    logits = torch.zeros(2, VOCAB)
    logits[0, [4, 9, 2]] = torch.tensor([3.0, 2.0, 1.0])
    logits[1, [5, 6, 8]] = torch.tensor([1.0, 3.0, 2.0])
    drafter.take_target_logits(torch.tensor([7, 20]), logits)
    assert drafter.table[7].tolist() == [4, 9, 2] and drafter.table[20].tolist() == [6, 8, 5]
    assert (np.delete(drafter.table, [7, 20], axis=0) == -1).all()


def test_graft_merges_a_chain_into_the_tree_like_a_trie():
    tree = Proposal(tokens=torch.tensor([5, 6, 7]), parents=torch.tensor([-1, -1, 0]))
    merged = graft(tree, [5, 7, 9])  # follows 5 -> 7, adds 9 below
    assert merged.tokens.tolist() == [5, 6, 7, 9] and merged.parents.tolist() == [-1, -1, 0, 2]
    apart = graft(tree, [8, 9])  # a new branch from the root
    assert apart.tokens.tolist() == [5, 6, 7, 8, 9] and apart.parents.tolist() == [-1, -1, 0, -1, 3]
    assert graft(Proposal.empty(), [4, 4]).parents.tolist() == [-1, 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_recycle_equals_hf_greedy(family):
    model = tiny_model(family, damp=0.1)
    drafter = TokenRecyclingDrafter(model.vocab_size)  # one drafter: its table carries over between prompts
    accepted = 0
    for prompt in prompts() * 2:
        result = Generator(model, drafter).generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS))
        assert result.token_ids == hf_greedy(model, prompt, NEW_TOKENS), family
        assert result.stats.new_tokens == 1 + sum(result.stats.accept_lengths)
        accepted += result.stats.accepted_draft_tokens
    assert accepted > 0, family


def test_sampled_recycling_emits_plain_sampling_tokens():
    """Its drafts are deterministic candidates: same seed, same tokens as plain sampling (`cats.verify.acceptance`)."""
    model = tiny_model("qwen3", damp=0.1)
    drafter = TokenRecyclingDrafter(model.vocab_size)
    accepted = 0
    for seed in range(3):
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, temperature=0.9, seed=seed, ignore_eos=True)
        plain = Generator(model).generate(prompts()[1], config)
        result = Generator(model, drafter).generate(prompts()[1], config)
        assert result.token_ids == plain.token_ids
        accepted += result.stats.accepted_draft_tokens
    assert accepted > 0


def test_recycle_settings_and_memory_needs():
    model = tiny_model("llama")
    drafter = make_drafter("recycle", model, DraftConfig(total_tokens=8, depth=3))
    assert drafter.describe() == {"name": "recycle", "total_tokens": 8, "depth": 3, "candidates": 8}
    with pytest.raises(InvalidArgumentError, match="--total-tokens and --depth"):
        make_drafter("recycle", model, DraftConfig(num_draft_tokens=4))
    with pytest.raises(InvalidArgumentError, match="--adapters"):
        make_drafter("recycle", model, DraftConfig(adapters="adapters"))
    needs = memory_needs(model.config, torch.float32, "recycle", DraftConfig(total_tokens=24))
    assert needs.min_resident_layers == 0 and needs.max_tree_tokens == 25
