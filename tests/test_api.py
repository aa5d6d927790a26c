"""The public face: `cats.generate` and `cats.stream` with the config objects, against plain decoding."""

from __future__ import annotations

import pytest

import cats
from tests.conftest import hf_greedy, tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.mark.parametrize("method, drafting", [
    ("ar", None),
    ("pld", cats.DraftConfig(num_draft_tokens=3)),
    ("early-exit", cats.DraftConfig(draft_layer=1, num_draft_tokens=3, threshold=0.0)),
    ("tree", cats.DraftConfig(draft_layer=1, tree_topk=2, total_tokens=6, depth=3)),
])
def test_generate_with_configs_equals_plain_greedy(llama, method, drafting):
    prompt = [5, 9, 13, 5, 9]
    result = cats.generate(llama, prompt, method, drafting=drafting,
                           generation=cats.GenerationConfig(max_new_tokens=20, ignore_eos=True))
    assert result.token_ids == hf_greedy(llama, prompt, 20)
    assert result.stats.method == method and result.stats.new_tokens == 20


def test_generate_takes_a_ready_drafter(llama):
    drafter = cats.draft.PromptLookupDrafter(num_tokens=4)
    result = cats.generate(llama, [5, 9, 13], drafter, generation=cats.GenerationConfig(max_new_tokens=12,
                                                                                         ignore_eos=True))
    assert result.token_ids == hf_greedy(llama, [5, 9, 13], 12) and result.stats.method == drafter.name


def test_a_setting_that_does_not_apply_is_refused(llama):
    with pytest.raises(cats.InvalidArgumentError, match="sparsity"):
        cats.generate(llama, [5, 9], "pld", drafting=cats.DraftConfig(sparsity=0.4))
    with pytest.raises(cats.UnknownMethodError, match="known methods"):
        cats.generate(llama, [5, 9], "nope")


def test_stream_yields_the_text_of_generate(stories_chat_dir):
    model = cats.load(str(stories_chat_dir))
    generation = cats.GenerationConfig(max_new_tokens=24, ignore_eos=True)
    stats = cats.GenerationStats()
    pieces = list(cats.stream(model, "Once upon a time", "pld", generation=generation, stats=stats))
    whole = cats.generate(model, "Once upon a time", "pld", generation=generation)
    assert "".join(pieces) == whole.text and len(pieces) > 1 and stats.new_tokens == 24


def test_every_registered_method_has_help_and_needs():
    for name, method in cats.METHODS.items():
        assert method.name == name and method.summary and callable(method.make) and callable(method.needs)
