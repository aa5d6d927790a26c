"""The public face: `load` a model, `generate` from it, `stream` its text.

    import cats
    model = cats.load("path/to/model.gguf")
    result = cats.generate(model, "Tell me a story.", method="pld", chat=True,
                           generation=cats.GenerationConfig(max_new_tokens=64))
    print(result.text, result.stats.tokens_per_s)

Settings come as one dataclass per concern (`cats.config`): `GenerationConfig` (length, stop, sampling, acceptance),
`DraftConfig` (the drafter's settings), `MemoryConfig` (a memory budget), `KernelConfig` (dtype, packed kernels).
The methods are those of `cats.methods`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import AutoConfig
from transformers.utils import logging as hf_logging

from cats.config import DraftConfig, GenerationConfig, KernelConfig, MemoryConfig
from cats.draft.base import Drafter
from cats.errors import InvalidArgumentError, NoTokenizerError
from cats.loop.generator import GenerationResult, Generator
from cats.loop.stats import GenerationStats
from cats.loop.text import IncrementalDetokenizer
from cats.methods import METHODS, check_method, make_drafter, make_scorer, memory_needs
from cats.model import LayeredModel, load_model
from cats.model.gguf_offload import stream_gguf_layers
from cats.model.load import runnable_gguf
from cats.model.kernels.packing import check_packing
from cats.model.source import config_folder, load_tokenizer, resolve_dtype
from cats.model.weights.budget import LIBRARY_PAGES, parse_budget
from cats.model.weights.offload import offload_model
from cats.model.weights.rss import anonymous_rss_bytes, return_freed_memory
from cats.prompts import check_token_ids, encode_prompt, encode_with


def load(model: str | os.PathLike, kernels: KernelConfig | None = None, memory: MemoryConfig | None = None,
         method: str = "ar", drafting: DraftConfig | None = None, context_tokens: int | None = None,
         tokenizer=None) -> LayeredModel:
    """Load ``model`` (a local HF folder, a ``.gguf`` file or a folder holding one, or a Hub id).

    ``kernels``: its dtype and packed kernels. ``memory``: run under a memory budget, streaming the deep layers
    from a layer store (docs/memory.md), planned for ``method`` with ``drafting`` (the layers and adapters its
    drafts need stay resident) and a KV cache of ``context_tokens``. ``tokenizer``: the model's, if already loaded."""
    _check_source(model)
    drafting, memory, kernels = _settings(None, drafting, memory, kernels)[1:]
    if not isinstance(method, str):
        raise InvalidArgumentError(f"method must be a method name ({', '.join(METHODS)}), got {method!r}")
    check_method(method)
    if memory.budget is None:
        return load_model(model, dtype=kernels.dtype, pack_weights=kernels.pack_weights, kernels=kernels.kernels,
                          tokenizer=tokenizer)
    return prepare(model, method, drafting, memory, kernels, context_tokens=context_tokens, tokenizer=tokenizer)


def context_window(model: str | os.PathLike) -> int:
    """The context window ``model``'s config declares (``max_position_embeddings``; 0 where it declares none), read
    without loading any weight."""
    _check_source(model)
    return int(getattr(AutoConfig.from_pretrained(config_folder(model)), "max_position_embeddings", 0) or 0)


def prepare(model: str | os.PathLike | LayeredModel, method: str, drafting: DraftConfig | None, memory: MemoryConfig,
            kernels: KernelConfig | None = None, context_tokens: int | None = None, tokenizer=None,
            prompt_tokens: int | None = None) -> LayeredModel:
    """``model`` (a path or Hub id to load, or a `LayeredModel` in memory) ready to run ``method`` under
    ``memory.budget``, with the method's needs (`cats.methods.memory_needs`) in the plan. A model already under the
    same budget is returned as it is. ``tokenizer``: the model's tokenizer if already loaded (not loaded twice)."""
    kernels = kernels or KernelConfig()
    if kernels.pack_weights:
        check_packing(resolve_dtype(kernels.dtype), memory.budget)
    if isinstance(model, LayeredModel):
        config, torch_dtype, on_blocks = model.config, model.dtype, model.on_blocks
    else:
        torch_dtype = resolve_dtype(kernels.dtype)
        config = AutoConfig.from_pretrained(config_folder(model))
        float_settings = torch_dtype != torch.float32 or kernels.pack_weights
        on_blocks = runnable_gguf(model, kernels.kernels, float_settings, quiet=True) is not None
    needs = memory_needs(config, torch_dtype, method, drafting, context_tokens=context_tokens,
                         prefetch=memory.prefetch, prompt_tokens=prompt_tokens, on_blocks=on_blocks)
    if memory.process:  # the budget is the process's: what it holds before any weight is read is planned for too
        return_freed_memory()  # what loading the tokenizer freed is not held against the weights
        needs.runtime_bytes = anonymous_rss_bytes() or 0  # its file pages are the kernel's to reclaim (see rss.py)
        needs.library_pages_bytes = LIBRARY_PAGES  # but not those every step reads
    if not isinstance(model, LayeredModel):
        return load_model(model, dtype=torch_dtype, memory_budget=memory.budget, memory_needs=needs,
                          offload_io=memory.offload_io, layer_store=memory.layer_store, tokenizer=tokenizer,
                          kernels=kernels.kernels)
    if model.memory_plan is not None:
        if parse_budget(memory.budget, model.memory_plan.parts.weights) != model.memory_plan.budget:
            raise InvalidArgumentError("this model already runs under another memory budget; load it again to change it")
        return model
    if getattr(model.hf_model, "gguf_mapping", None) is not None:  # on a GGUF file's blocks: streamed from the file
        plan, streamer = stream_gguf_layers(model.hf_model, memory.budget, needs, memory.offload_io,
                                            memory.layer_store)
        model.attach_weights(streamer, plan)
        return model
    offload_model(model, memory.budget, needs, memory.offload_io, memory.layer_store)
    return model


def generator_for(model: LayeredModel, method: str | Drafter = "ar", drafting: DraftConfig | None = None,
                  progress: bool = True) -> Generator:
    """A `Generator` for ``model`` with ``method``'s drafter and scorer (or a ready drafter)."""
    if isinstance(method, Drafter):
        drafter, name = method, method.name
    else:
        drafter, name = make_drafter(method, model, drafting, progress=progress), method
    return Generator(model, drafter, method=name, scorer=make_scorer(name, model, drafter, drafting))


class _Run:
    """What one `generate` / `stream` call decodes with: the model (loaded here when given a path), its generator,
    the prompt's ids and the validated settings."""

    def __init__(self, model, prompt, method, generation, drafting, memory, kernels, chat):
        if not isinstance(model, LayeredModel):
            _check_source(model)
        if not isinstance(chat, bool):
            raise InvalidArgumentError(f"chat must be True or False, got {chat!r}")
        self.config, drafting, memory, kernels = _settings(generation, drafting, memory, kernels)  # before loading
        method = _check_method(method)
        if not isinstance(prompt, str):
            check_token_ids(prompt)  # its type now; the vocabulary once the model is loaded
        budget = memory.budget is not None
        if budget and isinstance(method, Drafter):
            raise InvalidArgumentError("a memory budget plans for a method; pass method=NAME, not a ready drafter")
        self.loaded_here = not isinstance(model, LayeredModel)  # a model loaded here stops streaming when done
        if budget:
            tokenizer = model.tokenizer if isinstance(model, LayeredModel) else load_tokenizer(model)
            prompt_ids = encode_with(tokenizer, getattr(model, "name", str(model)), prompt, chat=chat)
            model = prepare(model, method, drafting, memory, kernels,
                            context_tokens=len(prompt_ids) + self.config.max_new_tokens, tokenizer=tokenizer,
                            prompt_tokens=len(prompt_ids))
        elif self.loaded_here:
            model = load_model(model, dtype=kernels.dtype, pack_weights=kernels.pack_weights, kernels=kernels.kernels)
        self.model = model
        try:
            self.generator = generator_for(model, method, drafting)
            self.prompt_ids = encode_prompt(model, prompt, chat=chat)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.loaded_here:
            self.model.close()


def generate(model: LayeredModel | str, prompt: str | Sequence[int], method: str | Drafter = "ar", *,
             generation: GenerationConfig | None = None, drafting: DraftConfig | None = None,
             memory: MemoryConfig | None = None, kernels: KernelConfig | None = None, chat: bool = False,
             on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """Generate from ``prompt`` (text, or token ids) with ``method`` (a name in `cats.methods.METHODS`, or a ready
    drafter).

    ``model``: a `LayeredModel`, or anything `load` accepts (loaded with ``kernels``, closed when done).
    ``generation``: greedy by default; ``temperature`` > 0 samples, and every method keeps plain sampling's
    distribution; ``acceptance="typical"`` is Medusa's lossy typical acceptance. ``memory``: run under a memory
    budget, streaming the deep layers from a layer store (docs/memory.md); a path is loaded under it, a model in
    memory has its streamed layers dropped in place; the KV cache is planned for this prompt plus
    ``max_new_tokens``. ``chat``: the prompt is one user message through the chat template. ``on_tokens``: called
    with each chunk of new token ids as it is committed."""
    if on_tokens is not None and not callable(on_tokens):
        raise InvalidArgumentError(f"on_tokens must be a function of the new token ids, got {on_tokens!r}")
    run = _Run(model, prompt, method, generation, drafting, memory, kernels, chat)
    try:
        return run.generator.generate(run.prompt_ids, run.config, on_tokens=on_tokens)
    finally:
        run.close()


def stream(model: LayeredModel | str, prompt: str | Sequence[int], method: str | Drafter = "ar", *,
           generation: GenerationConfig | None = None, drafting: DraftConfig | None = None,
           memory: MemoryConfig | None = None, kernels: KernelConfig | None = None, chat: bool = False,
           stats: GenerationStats | None = None) -> Iterator[str]:
    """`generate`, yielding the text as it is committed (pieces whose concatenation is the whole text, stop strings
    cut off); ``stats``, if given, is filled when the generator is exhausted."""
    if stats is not None and not isinstance(stats, GenerationStats):
        raise InvalidArgumentError(f"stats must be a cats.GenerationStats, got {type(stats).__name__}")
    run = _Run(model, prompt, method, generation, drafting, memory, kernels, chat)
    try:
        if run.model.tokenizer is None:
            raise NoTokenizerError(f"model {run.model.name!r} has no tokenizer: use generate() for token ids",
                                   run.model.name)
        text = IncrementalDetokenizer(run.model.tokenizer, run.config.stop)
        for chunk in run.generator.stream(run.prompt_ids, run.config, stats if stats is not None else GenerationStats()):
            delta = text.add(chunk)
            if delta:
                yield delta
        rest = text.finish()
        if rest:
            yield rest
    finally:
        run.close()


def _check_source(model) -> None:
    if not isinstance(model, (str, os.PathLike)):
        raise InvalidArgumentError(f"model must be a loaded model (cats.load) or a path, .gguf file or Hub id, got "
                                   f"{type(model).__name__} {model!r}")


def _check_method(method):
    if isinstance(method, Drafter):
        return method
    if not isinstance(method, str):
        raise InvalidArgumentError(f"method must be a method name ({', '.join(METHODS)}) or a drafter, got "
                                   f"{type(method).__name__} {method!r}")
    return check_method(method)


def _settings(generation, drafting, memory, kernels):
    """The settings objects, defaults for None, each checked for its type and validated."""
    settings = []
    for name, value, kind in (("generation", generation, GenerationConfig), ("drafting", drafting, DraftConfig),
                              ("memory", memory, MemoryConfig), ("kernels", kernels, KernelConfig)):
        if value is None:
            value = kind()
        elif not isinstance(value, kind):
            raise InvalidArgumentError(f"{name} must be a cats.{kind.__name__}, got {type(value).__name__} {value!r}")
        value.validate()
        settings.append(value)
    return tuple(settings)


def set_threads(threads: int) -> None:
    """Torch's CPU threads."""
    if threads < 1:
        raise InvalidArgumentError(f"--threads must be at least 1, got {threads}")
    torch.set_num_threads(threads)


def quiet_transformers() -> None:
    """No transformers warnings or progress bars (CATS reports its own)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
