"""From the settings a user asks for (server request, chat flags) to a `GenerationConfig`.

Sampling (temperature, top_p, top_k, seed) is passed on only where this build's `GenerationConfig` has those
fields. Where it has not, a request for temperature > 0 is refused, never decoded greedily behind the user's back;
top_p, top_k and seed alone are accepted with temperature 0, since greedy decoding does not depend on them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from cats.errors import InvalidArgumentError
from cats.generate import GenerationConfig

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")


class OptionError(InvalidArgumentError):
    """A bad or unavailable decoding option; ``param`` names it (the server reports it to the client)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def sampling_available() -> bool:
    """Whether this build's `GenerationConfig` can sample (has a ``temperature`` field)."""
    return "temperature" in {f.name for f in dataclasses.fields(GenerationConfig)}


def default_temperature() -> float:
    """The temperature of a request that names none: OpenAI's 1.0 where sampling exists, else 0 (greedy)."""
    return 1.0 if sampling_available() else 0.0


def make_config(
    max_new_tokens: int,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
) -> GenerationConfig:
    """A validated `GenerationConfig`; ``temperature=None`` means `default_temperature()`."""
    temperature = default_temperature() if temperature is None else float(temperature)
    if temperature < 0:
        raise OptionError(f"temperature must be >= 0, got {temperature:g}", "temperature")
    if top_p is not None and not 0 < top_p <= 1:
        raise OptionError(f"top_p must be in (0, 1], got {top_p:g}", "top_p")
    if top_k is not None and top_k < 0:
        raise OptionError(f"top_k must be >= 0, got {top_k}", "top_k")
    sampling = {}
    if sampling_available():
        sampling = {name: value for name, value in
                    (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed))
                    if value is not None}
    elif temperature > 0:
        raise OptionError(f"temperature {temperature:g} asks for sampling, which this build of CATS does not have "
                          "yet: use temperature 0 (greedy decoding)", "temperature")
    config = GenerationConfig(max_new_tokens=max_new_tokens, stop=tuple(stop), ignore_eos=ignore_eos, **sampling)
    try:
        config.validate()
    except InvalidArgumentError as error:
        param = next((name for name in ("max_new_tokens", "stop", *SAMPLING_FIELDS) if name in str(error)), None)
        raise OptionError(str(error), {"max_new_tokens": "max_tokens"}.get(param, param)) from None
    return config
