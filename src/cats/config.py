"""The settings `cats.generate` takes, one dataclass per concern, each validated where it is made.

* `GenerationConfig`: how many tokens, when to stop, greedy or sampled, and the acceptance rule;
* `DraftConfig`: the drafter's settings (draft length and layer, adapters, tree shape, layer-skip sparsity, the
  shallow verifier's cascade);
* `MemoryConfig`: the memory budget and how streamed layers are read;
* `KernelConfig`: the dtype a model is loaded in and whether its linears run on the packed CPU kernels.

`request_config` turns what a user asks for (a server request, chat flags) into a `GenerationConfig`, with errors
that name the option (`OptionError.param`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from cats.errors import InvalidArgumentError
from cats.model.source import resolve_dtype
from cats.model.weights.stream import IO_MODES
from cats.sampling import check_sampling
from cats.verify.acceptance import check_acceptance, make_acceptance
from cats.verify.cascade import SV_THRESHOLD

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")
DEFAULT_TEMPERATURE = 1.0  # of a request that names none (OpenAI's default)


@dataclass
class GenerationConfig:
    """Generation settings (the `generate`-like keywords)."""

    max_new_tokens: int = 128
    stop: Sequence[str] = ()  # stop strings: generation ends after the token that completes one (kept in output)
    eos_token_ids: set[int] | None = None  # None: the model's own end-of-sequence ids
    ignore_eos: bool = False
    temperature: float = 0.0  # 0 = greedy; > 0 = sample from the warped distribution
    top_p: float = 1.0  # nucleus filtering (1 = off)
    top_k: int = 0  # top-k filtering (0 = off)
    seed: int | None = None  # seed of the generation's random stream (None: drawn from torch's global generator)
    acceptance: str = "exact"  # "exact" (lossless) or "typical" (Medusa's posterior threshold; lossy, opt-in)
    typical_tau: float | None = None  # typical acceptance: hard threshold (None: 0.09)
    typical_alpha: float | None = None  # typical acceptance: entropy-scaled threshold factor (None: 0.3)

    def validate(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise InvalidArgumentError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidArgumentError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(not s for s in self.stop):
            raise InvalidArgumentError("stop strings must not be empty")
        if self.eos_token_ids is not None and (not isinstance(self.eos_token_ids, (set, frozenset, list, tuple))
                                               or not all(_is_int(t) and t >= 0 for t in self.eos_token_ids)):
            raise InvalidArgumentError(f"eos_token_ids must be a set of token ids, got {self.eos_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgumentError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not isinstance(self.acceptance, str):
            raise InvalidArgumentError(f"acceptance must be 'exact' or 'typical', got {self.acceptance!r}")
        check_sampling(self.temperature, self.top_p, self.top_k, self.seed)
        check_acceptance(self.acceptance, self.typical_tau, self.typical_alpha)
        make_acceptance(self.acceptance, self.temperature, self.typical_tau, self.typical_alpha)  # range checks


@dataclass
class DraftConfig:
    """The drafter's settings; None means the method's default (see `cats.methods`)."""

    num_draft_tokens: int | None = None  # tokens drafted per step (pld 10, early-exit 4)
    draft_layer: int | None = None  # early-exit layer L_d (default: depth / 8)
    max_ngram: int = 3  # longest n-gram prompt lookup matches
    adapters: str | None = None  # folder of trained adapters (draft/, early-exit/, feature/, shallow/)
    threshold: float | None = None  # confidence stop (None: the method's default)
    tree_topk: int | None = None  # tree shape: children per expanded node
    total_tokens: int | None = None  # tree shape: nodes verified
    depth: int | None = None  # tree shape: maximum depth
    sparsity: float | Sequence[float] | None = None  # layer-skip's fraction of skipped sublayers (dytc: a list)
    sv_threshold: float = SV_THRESHOLD  # cats: the shallow verifier prunes nodes it gives a probability below this
    sv_passes: int = 1  # cats: shallow passes per deep pass

    def validate(self) -> None:
        """Types and ranges, before any model is loaded or calibrated (a drafter checks what needs the model, such
        as whether its draft layer exists)."""
        if self.adapters is not None:
            self.adapters = _path_text(self.adapters, "adapters")
        for name in ("num_draft_tokens", "draft_layer", "tree_topk", "total_tokens", "depth"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and value >= 1):
                raise InvalidArgumentError(f"{name} must be an integer >= 1 (None: the method's default), got {value!r}")
        if not (_is_int(self.max_ngram) and self.max_ngram >= 1):
            raise InvalidArgumentError(f"max_ngram must be an integer >= 1, got {self.max_ngram!r}")
        if self.threshold is not None and not (_is_number(self.threshold) and 0 <= self.threshold < 1):
            raise InvalidArgumentError(f"threshold (the draft confidence stop) must lie in [0, 1), got {self.threshold!r}")
        if self.sparsity is not None:
            self.sparsities(())  # checks them
        if not (_is_number(self.sv_threshold) and 0 <= self.sv_threshold < 1):
            raise InvalidArgumentError(f"sv_threshold must lie in [0, 1), got {self.sv_threshold!r}")
        if not (_is_int(self.sv_passes) and self.sv_passes >= 1):
            raise InvalidArgumentError(f"sv_passes must be an integer >= 1, got {self.sv_passes!r}")

    def sparsities(self, default: tuple[float, ...]) -> tuple[float, ...]:
        """``sparsity`` as a tuple of distinct floats in (0, 1) (``default`` when None)."""
        if self.sparsity is None:
            return default
        values = (self.sparsity,) if _is_number(self.sparsity) else self.sparsity
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise InvalidArgumentError(f"sparsity must be a number in (0, 1) or a list of them, got {self.sparsity!r}")
        if not values:
            raise InvalidArgumentError("--sparsity is empty")
        for v in values:
            if not (_is_number(v) and 0 < v < 1):
                raise InvalidArgumentError(f"sparsity must lie in (0, 1), got {v!r}")
        if len(set(values)) != len(values):
            raise InvalidArgumentError(f"--sparsity repeats a value: {', '.join(map(str, values))}")
        return tuple(float(v) for v in values)


@dataclass
class MemoryConfig:
    """Running under a memory budget: ``budget`` in bytes, ``"300MiB"``, ``"50%"`` of the model's bytes in the
    format it runs in, or a sum (``"50%+384MiB"``) (None: no budget); ``offload_io`` ``direct`` (O_DIRECT) or
    ``buffered``; ``prefetch`` streamed layers read ahead (None: left to the plan, 2 where that keeps as many
    layers resident as 1, else 1); ``layer_store``: where the layer store lives (default
    ``$CATS_CACHE/layers``). ``process``: the budget is the whole process's memory, as the kernel charges it (the
    command line's ``--memory-budget``): what the process holds before any weight is read (its anonymous memory when
    the model is planned: interpreter, libraries' data, tokenizer) is measured and planned for too, with 32 MiB of
    page cache for the library pages every step reads (`cats.model.weights.budget.LIBRARY_PAGES`); the other file
    pages are left to the kernel, which drops the cold ones under a limit. False (the library's
    default, where the process may hold other things): the budget is the model's own memory, weights, KV cache,
    activations and buffers."""

    budget: str | int | None = None
    offload_io: str = "direct"
    prefetch: int | None = None
    layer_store: str | None = None
    process: bool = False

    def validate(self) -> None:
        if self.budget is not None and not (isinstance(self.budget, str) or (_is_int(self.budget) and self.budget > 0)):
            raise InvalidArgumentError(f"the memory budget must be bytes (an integer > 0), a size such as '300MiB', or "
                                       f"a percentage such as '50%', got {self.budget!r}")
        if self.offload_io not in IO_MODES:
            raise InvalidArgumentError(f"offload_io must be one of {', '.join(IO_MODES)}, got {self.offload_io!r}")
        if self.prefetch is not None and not (_is_int(self.prefetch) and self.prefetch >= 0):
            raise InvalidArgumentError(f"prefetch must be an integer >= 0, got {self.prefetch!r}")
        if self.layer_store is not None:
            self.layer_store = _path_text(self.layer_store, "layer_store")
        if not isinstance(self.process, bool):
            raise InvalidArgumentError(f"process must be True or False, got {self.process!r}")


KERNEL_CHOICES = ("auto", "aten")


@dataclass
class KernelConfig:
    """How a model is loaded for compute. ``kernels``: ``auto`` runs a GGUF file on its own quantised blocks
    (`cats.model.kernels.quantized`, float32 activations) and any other checkpoint on float weights; ``aten``
    dequantises a GGUF file to float weights (the float path, for checking). For float weights: their ``dtype`` and
    whether their linears run on packed copies on the row-invariant CPU kernels (``pack_weights``, bfloat16 or
    float32)."""

    dtype: str = "float32"
    pack_weights: bool = False
    kernels: str = "auto"

    def validate(self) -> None:
        resolve_dtype(self.dtype)  # an unknown dtype names the known ones
        if self.kernels not in KERNEL_CHOICES:
            raise InvalidArgumentError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernels!r}")
        if not isinstance(self.pack_weights, bool):
            raise InvalidArgumentError(f"pack_weights must be True or False, got {self.pack_weights!r}")


def _path_text(value, name: str) -> str:
    if isinstance(value, str) or hasattr(value, "__fspath__"):
        return str(value)
    raise InvalidArgumentError(f"{name} must be a folder path, got {type(value).__name__} {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


class OptionError(InvalidArgumentError):
    """A bad decoding option; ``param`` names it (the server reports it to the client)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def request_config(
    max_new_tokens: int,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
) -> GenerationConfig:
    """A validated `GenerationConfig` from a user's request; ``temperature=None`` means `DEFAULT_TEMPERATURE`.
    top_p, top_k and seed are accepted with temperature 0 (OpenAI's API accepts them): greedy decoding does not
    depend on them, so they are not passed on then."""
    temperature = DEFAULT_TEMPERATURE if temperature is None else float(temperature)
    if temperature < 0:
        raise OptionError(f"temperature must be >= 0, got {temperature:g}", "temperature")
    if top_p is not None and not 0 < top_p <= 1:
        raise OptionError(f"top_p must be in (0, 1], got {top_p:g}", "top_p")
    if top_k is not None and top_k < 0:
        raise OptionError(f"top_k must be >= 0, got {top_k}", "top_k")
    sampling = {name: value for name, value in
                (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed))
                if value is not None}
    if temperature == 0:  # greedy: top_p, top_k and seed change nothing (GenerationConfig refuses them there)
        sampling = {"temperature": 0.0}
    config = GenerationConfig(max_new_tokens=max_new_tokens, stop=tuple(stop), ignore_eos=ignore_eos, **sampling)
    try:
        config.validate()
    except InvalidArgumentError as error:
        param = next((name for name in ("max_new_tokens", "stop", *SAMPLING_FIELDS) if name in str(error)), None)
        raise OptionError(str(error), {"max_new_tokens": "max_tokens"}.get(param, param)) from None
    return config
