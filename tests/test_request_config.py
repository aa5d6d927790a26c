"""A user's request (server, chat) -> GenerationConfig: settings pass through, errors name their parameter."""

from __future__ import annotations

import pytest

from cats.config import DEFAULT_TEMPERATURE, OptionError, request_config


def test_the_settings_pass_through():
    config = request_config(8, temperature=0.7, top_p=0.9, top_k=40, seed=3)
    assert (config.temperature, config.top_p, config.top_k, config.seed) == (0.7, 0.9, 40, 3)
    assert request_config(8).temperature == DEFAULT_TEMPERATURE == 1.0  # OpenAI's default
    assert request_config(8, temperature=0).temperature == 0.0


def test_greedy_drops_the_sampling_only_settings():
    config = request_config(8, stop=["x"], ignore_eos=True, temperature=0, top_p=0.5, seed=3)
    assert (config.max_new_tokens, tuple(config.stop), config.ignore_eos) == (8, ("x",), True)
    assert (config.top_p, config.seed) == (1.0, None)


@pytest.mark.parametrize("kwargs, param", [
    ({"max_new_tokens": 0}, "max_tokens"),
    ({"max_new_tokens": 4, "stop": [""]}, "stop"),
    ({"max_new_tokens": 4, "top_p": 0.0}, "top_p"),
    ({"max_new_tokens": 4, "top_k": -1}, "top_k"),
    ({"max_new_tokens": 4, "temperature": -1.0}, "temperature"),
])
def test_bad_settings_name_their_parameter(kwargs, param):
    with pytest.raises(OptionError) as error:
        request_config(**kwargs)
    assert error.value.param == param
