"""Loading a target model as a `LayeredModel`: in memory, or under a memory budget (deep layers streamed), with
the linears optionally packed for the CPU kernels. Where the files come from: `cats.model.source`."""

from __future__ import annotations

import os
import pickle

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM

from cats.errors import (
    CatsError,
    DamagedFileError,
    InvalidArgumentError,
    ModelNotFoundError,
)
from cats.cache_files import notice
from cats.model.files import check_loading_info, check_model_folder
from cats.model.gguf_model import Unsupported, check_runnable, load_gguf_model
from cats.model.gguf_offload import load_gguf_under_budget
from cats.model.kernels.packing import check_packing, pack_linears
from cats.model.layered import LayeredModel, check_supported
from cats.model.source import (
    first_line,
    gguf_file,
    gguf_metadata,
    load_tokenizer_from,
    local_folder,
    resolve_dtype,
)
from cats.model.weights.large_pages import read_in_large_pages
from cats.model.weights.offload import load_under_budget

SMALL_PAGES_MARKER = "small-pages.json"  # in a GGUF file's metadata folder: refilling its cache gave no 2 MiB pages


def check_device(device) -> None:
    """A device this machine has: ``cpu``, or an accelerator torch can use here."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as error:
        raise InvalidArgumentError(f"device {device!r} is not a torch device ({first_line(error)}); use 'cpu'") from None
    available = kind == "cpu" or (getattr(torch, kind, None) is not None and hasattr(getattr(torch, kind), "is_available")
                                  and getattr(torch, kind).is_available())
    if not available:
        raise InvalidArgumentError(f"device {device!r}: this machine has no {kind} device torch can use; use 'cpu'")


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
    kernels: str = "auto",
) -> LayeredModel:
    """Load ``model`` (local folder, ``.gguf`` file, folder holding one ``.gguf``, or Hub id) as a `LayeredModel`.

    With ``memory_budget`` (bytes, ``"300MiB"``, ``"1.5GB"`` or ``"50%"`` of the weight bytes) only the parts the
    plan keeps resident are read; the deep layers stream: a GGUF file on its blocks from the file itself
    (`cats.model.gguf_offload`), other models from a per-layer store made once under ``$CATS_CACHE/layers`` (or
    ``layer_store``). ``memory_needs`` (`cats.model.weights.MemoryNeeds`, e.g. from
    `cats.methods.memory_needs` for a method) says what else must fit; ``offload_io`` is ``buffered`` or
    ``direct`` (see docs/memory.md). The plan is ``model.memory_plan``. ``tokenizer``: one already loaded for this
    model (e.g. to size the plan from the prompt), used instead of loading it again. ``pack_weights``
    (bfloat16 or float32): run the decoder layers' and the lm_head's linears through packed copies of their weights
    (`cats.model.kernels.packing.pack_linears`), on the row-invariant AVX-512 kernels of `cats.model.kernels.avx512` where they run
    (attention over few tokens too), else on oneDNN; faster on CPUs, about the weights' size of extra memory.
    ``kernels``: ``auto`` runs a GGUF file on its own blocks (memory-mapped, `cats.model.gguf_model`; float32
    activations; where the quantised kernels cannot run it, the float path with a one-line notice), ``aten``
    dequantises it to float weights of ``dtype``. Other checkpoints run on float weights either way.

    Raises:
        ModelNotFoundError: no such path, and not a reachable Hub id.
        MissingDependencyError: a GGUF file without the ``gguf`` package.
        UnsupportedArchitectureError: an architecture CATS cannot drive.
        BudgetTooSmallError: a budget below the resident minimum (the message names it).
    """
    torch_dtype = resolve_dtype(dtype)
    check_device(device)
    if pack_weights:
        check_packing(torch_dtype, memory_budget)
    if memory_budget is not None and device != "cpu":
        raise InvalidArgumentError(f"a memory budget streams layers into CPU memory; device {device!r} is not supported")
    gguf = runnable_gguf(model, kernels, float_settings=torch_dtype != torch.float32 or pack_weights)
    if gguf is not None:
        metadata = gguf_metadata(gguf)
        if tokenizer is None:
            tokenizer = load_tokenizer_from(str(metadata), model)
        weights, plan, pages = None, None, None
        if memory_budget is None:
            hf_model = load_gguf_model(gguf, metadata, attn_implementation)
            mapping = hf_model.gguf_mapping
            pages = read_in_large_pages(mapping.path, mapping.address, mapping.size, metadata / SMALL_PAGES_MARKER)
        else:
            hf_model, plan, weights = load_gguf_under_budget(gguf, metadata, memory_budget, memory_needs, offload_io,
                                                             attn_implementation, layer_store)
        layered = LayeredModel(hf_model, tokenizer, name=str(model))
        layered.attach_weights(weights, plan)
        layered.large_pages = pages
        return layered
    folder = local_folder(str(model))
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ModelNotFoundError(f"cannot read a model config from {model!r}: {first_line(error)}; "
                                 "if its config.json is damaged, re-download the model") from None
    check_supported(config)
    check_model_folder(folder)  # weights there, each safetensors file whole
    if tokenizer is None:
        tokenizer = load_tokenizer_from(folder, model)  # first: what it allocates then stays below the weights
    weights, plan = None, None
    if memory_budget is None:
        hf_model = load_weights(folder, torch_dtype, attn_implementation).to(device)
    else:
        hf_model, plan, weights = load_under_budget(folder, config, torch_dtype, memory_budget, memory_needs,
                                                    offload_io, layer_store, attn_implementation)
    layered = LayeredModel(hf_model, tokenizer, name=str(model))
    layered.attach_weights(weights, plan)
    if pack_weights:
        pack_linears(layered)
    return layered


def runnable_gguf(model, kernels: str, float_settings: bool, quiet: bool = False):
    """The GGUF file to run on its blocks (``kernels`` ``auto`` and the kernels take it), else None, with a notice
    (unless ``quiet``) where the float path runs it instead: the kernels cannot, or ``float_settings`` (a dtype other
    than float32, or packed weights: settings of float weights)."""
    if kernels not in ("auto", "aten"):
        raise InvalidArgumentError(f"kernels must be 'auto' or 'aten', got {kernels!r}")
    gguf = gguf_file(model) if kernels == "auto" else None
    if gguf is None:
        return None
    why = None
    if float_settings:
        why = (f"--dtype and --pack-weights are settings of float weights; running {gguf.name} dequantised to them "
               "(as --kernels aten)")
    else:
        try:
            check_runnable(gguf_metadata(gguf))
        except Unsupported as unsupported:
            why = f"{unsupported}; running {gguf.name} on dequantised float weights (as --kernels aten)"
    if why is not None:
        if not quiet:
            notice(why)
        return None
    return gguf


def load_weights(folder: str, dtype: torch.dtype, attn_implementation: str):
    """transformers' model of ``folder``, all of its tensors read from the files: what transformers raises on a
    damaged checkpoint, and the tensors it would silently start from random values, are a `DamagedFileError`."""
    try:
        hf_model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation,
                                                              output_loading_info=True)
    except CatsError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError, IndexError, TypeError, EOFError, SafetensorError,
            pickle.UnpicklingError) as error:
        raise DamagedFileError(folder, f"could not be loaded by transformers ({type(error).__name__}: "
                                       f"{first_line(error)})", "if a file in it is damaged, re-download the model") from error
    check_loading_info(info, folder)
    return hf_model
