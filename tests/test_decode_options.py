"""Request settings -> GenerationConfig: sampling passes through only where GenerationConfig has it."""

from __future__ import annotations

import dataclasses

import pytest

import cats.decode_options as options
from cats.decode_options import OptionError, make_config, sampling_available
from cats.generate import GenerationConfig


@dataclasses.dataclass
class SamplingConfig(GenerationConfig):
    """GenerationConfig as the sampling branch extends it."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@pytest.mark.skipif(sampling_available(), reason="this build samples")
def test_without_sampling_temperature_is_refused_and_the_default_is_greedy():
    config = make_config(8, stop=["x"], ignore_eos=True, top_p=0.5, seed=3)  # no-ops for greedy decoding
    assert (config.max_new_tokens, tuple(config.stop), config.ignore_eos) == (8, ("x",), True)
    assert not hasattr(config, "temperature") and options.default_temperature() == 0.0
    with pytest.raises(OptionError, match="sampling") as error:
        make_config(8, temperature=0.7)
    assert error.value.param == "temperature"


def test_with_sampling_the_settings_pass_through(monkeypatch):
    monkeypatch.setattr(options, "GenerationConfig", SamplingConfig)
    assert options.sampling_available() and options.default_temperature() == 1.0
    config = make_config(8, temperature=0.7, top_p=0.9, top_k=40, seed=3)
    assert (config.temperature, config.top_p, config.top_k, config.seed) == (0.7, 0.9, 40, 3)
    assert make_config(8).temperature == 1.0  # OpenAI's default once sampling exists
    assert make_config(8, temperature=0).temperature == 0.0


@pytest.mark.parametrize("kwargs, param", [
    ({"max_new_tokens": 0}, "max_tokens"),
    ({"max_new_tokens": 4, "stop": [""]}, "stop"),
    ({"max_new_tokens": 4, "top_p": 0.0}, "top_p"),
    ({"max_new_tokens": 4, "top_k": -1}, "top_k"),
    ({"max_new_tokens": 4, "temperature": -1.0}, "temperature"),
])
def test_bad_settings_name_their_parameter(kwargs, param):
    with pytest.raises(OptionError) as error:
        make_config(**kwargs)
    assert error.value.param == param
