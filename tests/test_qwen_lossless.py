"""The contract on a real 1.5B model on its own quantised blocks (`-m slow`: fetched once by
``../shared/tools/get-model``, 1.1 GB, never in the default run): Qwen2.5-Coder-1.5B-Instruct Q4_K_M, every drafter
kind reproduces the model's own plain greedy decoding token for token (the kernels are row-invariant: no allowance).
Adapters are untrained (initialised from the target's own layers) and the skip set is fixed: losslessness must not
depend on how good the drafts are."""

from __future__ import annotations

import subprocess

import pytest

import cats
from cats.config import DraftConfig, GenerationConfig
from cats.draft import EarlyExitDrafter, LayerSkipDrafter, PromptLookupDrafter, SkipSet, TreeDrafter
from cats.draft.dytc.scheduler import DraftOption, DyTCDrafter
from cats.draft.eagle import FeatureDrafter
from cats.draft.recycle import TokenRecyclingDrafter
from cats.loop.generator import Generator
from cats.methods import make_drafter
from cats.model.adapter import new_adapter
from cats.prompts import encode_prompt
from cats.verify.cascade import CascadeScorer
from tests.conftest import SHARED, proposal_sizes

pytestmark = pytest.mark.slow
GET_MODEL = SHARED / "tools" / "get-model"
PROMPTS = ["Write a Python function that returns the n-th Fibonacci number, with a docstring.",
           "Explain what a hash map is and give a short example in Python.",
           "def quicksort(items):\n    # sort a list; complete this function\n"]
NEW_TOKENS = 48
SKIP = SkipSet(attention=(6, 8, 10, 12, 14, 16, 18, 20), mlp=(9, 13, 17))


@pytest.fixture(scope="module")
def qwen():
    if not GET_MODEL.exists():
        pytest.skip(f"{GET_MODEL} not present (../shared missing)")
    done = subprocess.run([str(GET_MODEL), "qwen2.5-coder-1.5b-instruct"], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"could not fetch the model: {done.stderr.strip()[-300:]}")
    model = cats.load_model(done.stdout.strip().splitlines()[-1])
    assert model.weight_format == "GGUF Q4_K+Q6_K" and model.kernel_path.startswith("gguf-blocks/")
    return model


@pytest.fixture(scope="module")
def references(qwen):
    plain = Generator(qwen)
    cases = []
    for text in PROMPTS:
        prompt = encode_prompt(qwen, text, chat=True)
        cases.append((prompt, plain.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS)).token_ids))
    return cases


def drafter_for(model, method):
    vocab = list(range(16384))
    if method == "pld":
        return PromptLookupDrafter(num_tokens=8), None
    if method == "layer-skip":
        return LayerSkipDrafter(model, SKIP, num_tokens=4, assist=PromptLookupDrafter(6)), None
    if method == "layer-skip-tree":
        return LayerSkipDrafter(model, SKIP, num_tokens=4, tree_topk=3, total_tokens=10), None
    if method == "recycle":
        return TokenRecyclingDrafter(model.vocab_size, total_tokens=8), None
    if method == "eagle":
        feature = new_adapter(model, "draft", model.num_layers, input="features", vocab_subset=vocab).eval()
        return FeatureDrafter(model, feature, tree_topk=3, total_tokens=8, depth=3), None
    draft = new_adapter(model, "draft", 4, vocab_subset=vocab).eval()  # drafting, not training
    if method == "early-exit":
        return EarlyExitDrafter(model, num_tokens=4, adapter=draft, threshold=0.3), None
    tree = TreeDrafter(model, adapter=draft, tree_topk=3, total_tokens=8, depth=3)
    if method == "tree":
        return tree, None
    if method == "cats":
        return tree, CascadeScorer(model, new_adapter(model, "shallow", 14).eval(), drafter=tree, sv_threshold=0.05)
    skip = LayerSkipDrafter(model, SKIP, num_tokens=4, assist=PromptLookupDrafter(6))
    options = [DraftOption("ls<pld", skip, 4, 0.6, 0.7), DraftOption("draft-tree", tree, 8, 0.6, 0.2, tree=True),
               DraftOption("recycle", TokenRecyclingDrafter(model.vocab_size, total_tokens=8), 8, 0.6, 0.01, tree=True,
                           hindsight=True)]
    return DyTCDrafter(options, lookup=PromptLookupDrafter(num_tokens=8)), None


@pytest.mark.parametrize("method", ["pld", "layer-skip", "layer-skip-tree", "early-exit", "tree", "cats", "eagle",
                                    "recycle", "dytc"])
def test_qwen_on_blocks_matches_its_plain_decoding_exactly(qwen, references, method):
    drafter, scorer = drafter_for(qwen, method)
    generator = Generator(qwen, drafter, scorer=scorer) if scorer is not None else Generator(qwen, drafter)
    for prompt, expected in references:
        assert generator.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS)).token_ids == expected, method


@pytest.mark.parametrize("method, drafting", [("layer-skip", None), ("layer-skip", DraftConfig(tree_topk=2, depth=4,
                                                                                          total_tokens=10)),
                                              ("dytc", None)], ids=["layer-skip", "layer-skip-tree", "dytc"])
def test_qwen_under_a_budget_drafts_from_its_resident_layers_exactly(qwen, references, method, drafting):
    """Under a budget the layers of Qwen's shipped stream order stream from the file, and so does the lm_head past
    its draft-vocabulary rows (at 50 % it holds five layers more), and the skip draft runs the resident layers and
    those rows alone: every pass sweeps the streamed layers and the head's pieces once, and the output is the
    resident model's."""
    model = cats.load(qwen.name, memory=cats.MemoryConfig(budget="50%"), method=method, drafting=drafting,
                      context_tokens=400)
    plan = model.memory_plan
    assert plan.needs.stream_order and plan.streamed == tuple(sorted(plan.needs.stream_order[: len(plan.streamed)]))
    assert 0 < len(plan.streamed) < 28 and plan.streamed != tuple(range(plan.resident_layers, 28))
    assert plan.head_streamed and plan.head_chunks > 0
    drafter = make_drafter(method, model, drafting)
    sizes = proposal_sizes(drafter)
    generator = Generator(model, drafter, method=method)
    for prompt, expected in references:
        result = generator.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS))
        assert result.token_ids == expected, method
        assert result.stats.offload["acquires"] == plan.streamed_units * result.stats.target_forwards, method
    assert max(sizes) < plan.needs.max_tree_tokens  # x and the drafts: within the pass the plan reserved
    if method == "dytc":
        assert drafter.max_pass_tokens == plan.needs.max_tree_tokens in plan.needs.pass_sizes
    model.close()
