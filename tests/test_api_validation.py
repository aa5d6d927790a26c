"""The public API checks its arguments at the boundary: every bad argument is a library error that names it, raised
before any model is loaded or calibrated; token ids are checked against the vocabulary."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cats
from cats.cli import main
from tests.conftest import STORIES_HF, hf_greedy, needs, tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.mark.parametrize("prompt, message", [
    (b"Once", "bytes"),
    ([1.5, 2.7], "must be integers"),
    ([1, 99999], "outside the model's vocabulary"),
    ([3, -1], "outside the model's vocabulary"),
    (None, "got NoneType"),
    ([True, 3], "must be integers"),
    (torch.zeros(2, 3, dtype=torch.long), "one sequence"),
    (torch.tensor([1.0, 2.0]), "must be integers"),
])
def test_bad_prompts_are_refused(llama, prompt, message):
    with pytest.raises(cats.InvalidArgumentError, match=message):
        cats.generate(llama, prompt)


def test_token_ids_may_be_a_tensor(llama):
    result = cats.generate(llama, torch.tensor([5, 9, 13]), generation=cats.GenerationConfig(max_new_tokens=6,
                                                                                              ignore_eos=True))
    assert result.token_ids == hf_greedy(llama, [5, 9, 13], 6)


@pytest.mark.parametrize("kwargs, message", [
    ({"generation": cats.GenerationConfig(stop=5)}, "stop must be"),
    ({"generation": cats.GenerationConfig(stop=[5])}, "stop must be"),
    ({"generation": {"max_new_tokens": 4}}, "generation must be a cats.GenerationConfig"),
    ({"on_tokens": "x"}, "on_tokens"),
    ({"drafting": cats.DraftConfig(sparsity="0.4")}, "sparsity"),
    ({"drafting": cats.DraftConfig(adapters=3)}, "adapters must be a folder path"),
    ({"drafting": cats.DraftConfig(num_draft_tokens=0)}, "num_draft_tokens must be an integer >= 1"),
    ({"drafting": cats.DraftConfig(threshold=-1)}, r"threshold .* must lie in \[0, 1\)"),
    ({"memory": cats.MemoryConfig(offload_io="fast")}, "offload_io"),
    ({"memory": cats.MemoryConfig(budget=[1])}, "memory budget must be"),
    ({"memory": cats.MemoryConfig(budget=-5)}, "memory budget must be"),
    ({"kernels": cats.KernelConfig(dtype="int3")}, "unknown dtype"),
    ({"chat": "yes"}, "chat must be True or False"),
    ({"method": 3}, "method must be a method name"),
])
def test_bad_settings_name_their_argument(llama, kwargs, message):
    with pytest.raises(cats.InvalidArgumentError, match=message):
        cats.generate(llama, [5, 9], **kwargs)


def test_a_model_that_is_not_a_model_or_path_is_refused():
    with pytest.raises(cats.InvalidArgumentError, match="model must be"):
        cats.generate(42, "Once")
    with pytest.raises(cats.InvalidArgumentError, match="model must be"):
        cats.load(42)


@needs(STORIES_HF)
def test_an_unavailable_device_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(cats.InvalidArgumentError, match="no cuda device"):
        cats.load_model(STORIES_HF, device="cuda")


def test_drafting_settings_are_checked_before_calibration(llama, monkeypatch):
    import cats.methods as methods

    def calibrate(*args, **kwargs):
        raise AssertionError("calibrated before checking the settings")

    monkeypatch.setattr(methods, "load_or_calibrate", calibrate)
    with pytest.raises(cats.InvalidArgumentError, match="threshold"):
        methods.make_drafter("layer-skip", llama, cats.DraftConfig(threshold=-1))


@needs(STORIES_HF)
@pytest.mark.parametrize("flag, message", [
    (["--threshold", "-1", "--method", "layer-skip"], "threshold"),
    (["-k", "0", "--method", "pld"], "num_draft_tokens must be an integer >= 1"),
])
def test_cli_refuses_bad_drafting_settings_before_loading(flag, message, capsys, monkeypatch):
    import cats.cli.generate as command

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the arguments were checked")

    monkeypatch.setattr(command, "load", no_load)
    assert main(["generate", "--model", str(STORIES_HF), "--prompt", "Once", *flag]) == 2
    assert message.split(" ")[0] in capsys.readouterr().err


@needs(STORIES_HF)
def test_the_cli_says_why_a_generation_stopped(capsys):
    assert main(["generate", "--model", str(STORIES_HF), "--prompt", "Once", "--max-new-tokens", "5",
                 "--ignore-eos"]) == 0
    assert "stopped after --max-new-tokens (5 tokens)" in capsys.readouterr().err


ANYTHING = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**6), st.floats(allow_nan=True),
                     st.text(max_size=5), st.binary(max_size=5), st.lists(st.integers(-5, 200), max_size=4),
                     st.lists(st.floats(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=ANYTHING, setting=st.sampled_from(["max_new_tokens", "stop", "temperature", "top_p", "seed",
                                                  "num_draft_tokens", "threshold", "sparsity", "adapters",
                                                  "offload_io", "dtype", "chat", "method", "on_tokens"]),
       value=ANYTHING)
def test_random_arguments_end_in_a_library_error_or_an_answer(llama, prompt, setting, value):
    generation, drafting, memory, kernels, other = {}, {}, {}, {}, {}
    target = {"max_new_tokens": generation, "stop": generation, "temperature": generation, "top_p": generation,
              "seed": generation, "num_draft_tokens": drafting, "threshold": drafting, "sparsity": drafting,
              "adapters": drafting, "offload_io": memory, "dtype": kernels}.get(setting, other)
    target[setting] = value
    generation.setdefault("max_new_tokens", 3)
    try:
        result = cats.generate(llama, prompt, other.pop("method", "pld"), generation=cats.GenerationConfig(**generation),
                               drafting=cats.DraftConfig(**drafting), memory=cats.MemoryConfig(**memory),
                               kernels=cats.KernelConfig(**kernels), **other)
    except cats.CatsError:
        return
    assert 1 <= len(result.token_ids) == result.stats.new_tokens <= generation["max_new_tokens"]
