"""Loading a target model as a `LayeredModel`: in memory, or under a memory budget (deep layers streamed), with
the linears optionally packed for the CPU kernels. Where the files come from: `cats.model.source`."""

from __future__ import annotations

import os

import torch

from cats.errors import InvalidArgumentError, ModelNotFoundError
from cats.model.kernels.packing import check_packing, pack_linears
from cats.model.layered import LayeredModel, check_supported
from cats.model.source import (
    first_line,
    load_tokenizer_from,
    local_folder,
    resolve_dtype,
)
from cats.model.weights.offload import load_under_budget


def load_model(
    model: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    memory_budget: str | int | None = None,
    memory_needs=None,
    offload_io: str = "direct",
    layer_store: str | os.PathLike | None = None,
    tokenizer=None,
    pack_weights: bool = False,
) -> LayeredModel:
    """Load ``model`` (local folder, ``.gguf`` file, folder holding one ``.gguf``, or Hub id) as a `LayeredModel`.

    With ``memory_budget`` (bytes, ``"300MiB"``, ``"1.5GB"`` or ``"50%"`` of the weight bytes) only the parts the
    plan keeps resident are read; the deep layers stream from a per-layer store made once under
    ``$CATS_CACHE/layers`` (or ``layer_store``). ``memory_needs`` (`cats.model.weights.MemoryNeeds`, e.g. from
    `cats.methods.memory_needs` for a method) says what else must fit; ``offload_io`` is ``buffered`` or
    ``direct`` (see docs/memory.md). The plan is ``model.memory_plan``. ``tokenizer``: one already loaded for this
    model (e.g. to size the plan from the prompt), used instead of loading it again. ``pack_weights``
    (bfloat16 or float32): run the decoder layers' and the lm_head's linears through packed copies of their weights
    (`cats.model.kernels.packing.pack_linears`), on the row-invariant AVX-512 kernels of `cats.model.kernels.avx512` where they run
    (attention over few tokens too), else on oneDNN; faster on CPUs, about the weights' size of extra memory.

    Raises:
        ModelNotFoundError: no such path, and not a reachable Hub id.
        MissingDependencyError: a GGUF file without the ``gguf`` package.
        UnsupportedArchitectureError: an architecture CATS cannot drive.
        BudgetTooSmallError: a budget below the resident minimum (the message names it).
    """
    torch_dtype = resolve_dtype(dtype)
    if pack_weights:
        check_packing(torch_dtype, memory_budget)
    if memory_budget is not None and device != "cpu":
        raise InvalidArgumentError(f"a memory budget streams layers into CPU memory; device {device!r} is not supported")
    folder = local_folder(str(model))
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise ModelNotFoundError(f"cannot read a model config from {model!r}: {first_line(error)}") from None
    check_supported(config)
    if tokenizer is None:
        tokenizer = load_tokenizer_from(folder, model)  # first: what it allocates then stays below the weights
    weights, plan = None, None
    if memory_budget is None:
        hf_model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch_dtype, attn_implementation=attn_implementation
        ).to(device)
    else:
        hf_model, plan, weights = load_under_budget(folder, config, torch_dtype, memory_budget, memory_needs,
                                                    offload_io, layer_store, attn_implementation)
    layered = LayeredModel(hf_model, tokenizer, name=str(model))
    layered.attach_weights(weights, plan)
    if pack_weights:
        pack_linears(layered)
    return layered

