"""Every method `cats bench` can run, by name: CATS's own (the registry of `cats.methods`), the transformers
baselines, transformers + accelerate offloading, llama-cpp-python and llama.cpp's server."""

from __future__ import annotations

from cats.bench.llama_server import LLAMA_SERVER_METHODS, LlamaServerMethod
from cats.bench.methods import (
    HF_METHODS,
    LLAMA_CPP_METHODS,
    NEEDS_LIMIT,
    OFFLOAD_METHODS,
    UNBUDGETED,
    BenchContext,
    BenchMethod,
    CatsMethod,
    HfOffloadMethod,
    LlamaCppMethod,
    MethodUnavailableError,
    hf_method,
)
from cats.errors import InvalidArgumentError, UnknownMethodError
from cats.methods import METHODS as CATS_METHODS


def known_methods() -> tuple[str, ...]:
    return tuple(CATS_METHODS) + HF_METHODS + OFFLOAD_METHODS + LLAMA_CPP_METHODS + LLAMA_SERVER_METHODS


def parse_methods(text: str) -> list[str]:
    """``"ar,pld"`` -> ``["ar", "pld"]``; unknown or repeated names are errors listing the known ones."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise InvalidArgumentError("--methods is empty; known methods: " + ", ".join(known_methods()))
    known = known_methods()
    for name in names:
        if name not in known:
            raise UnknownMethodError(f"unknown method {name!r}; known methods: {', '.join(known)}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise InvalidArgumentError(f"--methods names {', '.join(repeated)} more than once")
    return names


def make_method(name: str, context: BenchContext) -> BenchMethod:
    """The method called ``name``; raises `MethodUnavailableError` for a known method that cannot run here."""
    if context.memory_budget is not None and name in HF_METHODS + LLAMA_CPP_METHODS:
        raise MethodUnavailableError(UNBUDGETED.format(name=name))
    if context.memory_budget is not None and name in LLAMA_SERVER_METHODS and context.cgroup is None:
        raise MethodUnavailableError(NEEDS_LIMIT.format(name=name))
    if name in CATS_METHODS:
        return CatsMethod(name, context)
    if name in HF_METHODS:
        return hf_method(name, context)
    if name in OFFLOAD_METHODS:
        return HfOffloadMethod(name, context)
    if name in LLAMA_CPP_METHODS:
        return LlamaCppMethod(name, context, prompt_lookup=name == "llama-cpp-pld")
    if name in LLAMA_SERVER_METHODS:
        return LlamaServerMethod(name, context)
    raise UnknownMethodError(f"unknown method {name!r}; known methods: {', '.join(known_methods())}")
