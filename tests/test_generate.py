"""Stopping, streaming, limits and bad input of the decode loop."""

from __future__ import annotations

import pytest

import cats
from cats.draft import EarlyExitDrafter, PromptLookupDrafter
from cats.errors import InvalidArgumentError, PromptTooLongError, UnknownMethodError
from cats.config import GenerationConfig
from cats.loop.generator import Generator
from tests.conftest import STORIES_HF, hf_greedy, needs, tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", damp=0.1)


def test_streamed_chunks_concatenate_to_the_result(llama):
    chunks = []
    result = Generator(llama, EarlyExitDrafter(llama, layer=1, num_tokens=4)).generate(
        [4, 5, 6], GenerationConfig(max_new_tokens=30, ignore_eos=True), on_tokens=chunks.append)
    assert sum(chunks, []) == result.token_ids and len(result.token_ids) == 30
    assert [len(c) for c in chunks] == [1] + result.stats.accept_lengths
    assert result.stats.stop_reason == "max_new_tokens"


def test_eos_stops_and_is_included(llama):
    free = Generator(llama).generate([4, 5, 6], GenerationConfig(max_new_tokens=30, ignore_eos=True)).token_ids
    eos = free[10]
    first = free.index(eos)
    for drafter in (None, PromptLookupDrafter(), EarlyExitDrafter(llama, layer=1)):
        result = Generator(llama, drafter).generate([4, 5, 6], GenerationConfig(max_new_tokens=30, eos_token_ids={eos}))
        assert result.token_ids == free[: first + 1]
        assert result.stats.stop_reason == "eos"


def test_context_window_limits_generation(llama):
    context = llama.context_length
    prompt = [7] * (context - 6)
    result = Generator(llama, PromptLookupDrafter()).generate(prompt, GenerationConfig(max_new_tokens=50, ignore_eos=True))
    assert result.stats.stop_reason == "context_length"
    assert len(result.token_ids) == 7  # the last token is predicted from position context - 1
    with pytest.raises(PromptTooLongError, match="context window"):
        Generator(llama).generate([7] * context, GenerationConfig(max_new_tokens=5))


def test_bad_arguments_raise_typed_errors(llama):
    with pytest.raises(InvalidArgumentError, match="max_new_tokens"):
        Generator(llama).generate([3], GenerationConfig(max_new_tokens=0))
    with pytest.raises(InvalidArgumentError, match="empty"):
        Generator(llama).generate([], GenerationConfig())
    with pytest.raises(InvalidArgumentError, match=r"draft layer 4 is outside \[1, 4\)"):
        EarlyExitDrafter(llama, layer=4)
    with pytest.raises(InvalidArgumentError, match="outside"):
        EarlyExitDrafter(llama, layer=0)
    with pytest.raises(UnknownMethodError, match="known methods: ar, pld, early-exit"):
        cats.generate(llama, [3, 4], method="medusa")
    with pytest.raises(InvalidArgumentError, match="tokenizer"):
        cats.generate(llama, "text needs a tokenizer")


@needs(STORIES_HF)
def test_text_prompt_stop_strings_and_hf_equality():
    model = cats.load_model(STORIES_HF)
    result = cats.generate(model, "Once upon a time", method="pld", generation=GenerationConfig(max_new_tokens=60))
    prompt_ids = model.tokenizer("Once upon a time")["input_ids"]
    assert result.prompt_token_ids == prompt_ids
    assert result.token_ids == hf_greedy(model, prompt_ids, 60)
    assert result.text.startswith(", there was a little girl named Lily")  # llama2.c's reference output
    stopped = cats.generate(model, "Once upon a time", method="early-exit", generation=GenerationConfig(max_new_tokens=60, stop=["Lily."]))
    assert stopped.stats.stop_reason == "stop_string"
    assert stopped.text.endswith("Lily.") and "Lily." not in model.tokenizer.decode(stopped.token_ids[:-1])
    assert stopped.token_ids == result.token_ids[: len(stopped.token_ids)]
