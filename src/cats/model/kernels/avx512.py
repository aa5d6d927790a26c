"""AVX-512 kernels for packed models: the linears, few-query attention and whole decoder layers of a forward, fast and
row-invariant.

A decode step multiplies one token (a verification: a few) by every weight of the model, so its time is the time to
stream the weights through the cores. oneDNN, the fastest library path torch offers here, reads a SmolLM2 layer's
small matrices at ~19 GB/s and pays ~17 µs per call, while this machine streams memory at ~33 GB/s
(docs/performance.md). The linear kernels in ``avx512.c`` store each weight in panels of 48 output rows, one
contiguous stream each, and multiply up to 8 input rows with every loaded vector of weights (bf16 by ``vdpbf16ps``
with float32 accumulation, float32 by FMA, each input value broadcast). All of SmolLM2-135M's projections, 2 threads,
same run, oneDNN / these kernels (ms): bf16 1 row 15.1 / 6.9, 16 rows 21.6 / 14.2, 64 rows 55.3 / 42.9; float32 1
row 25.6 / 18.8, 16 rows 52.0 / 23.7, 256 rows 362 / 330 (``benchmarks/avx512_kernels.py``). They are never slower,
so a packed model runs every linear on them when they are available, and keeps one packed copy. They prefetch the
weights 12 KB ahead, and from 9 rows on every tile of up to 64 rows works through each 12 KB chunk of a panel while
it is in L1, so memory and arithmetic overlap (bf16 16 rows: 1.06x one row's time, against 1.3x without). The
attention kernel serves forwards of up to `ATTENTION_QUERY_LIMIT` tokens: 1.4-4.8x packed SDPA on SmolLM2's heads.
`layer` runs a whole Llama-style decoder layer on those kernels in one call
(`cats.model.kernels.layer_forward.fused_layer_forward` decides where): about a quarter less time per one-token
forward than the same kernels called from the lean forward; `layers` runs consecutive ones in one call, so that no
Python runs cold between them. A model on GGUF blocks runs its layers through it too, its linears then the quantised
kernels' own (`cats.model.kernels.quantized.team_function`, called by the layer's thread team): Qwen2.5-Coder-1.5B
Q4_K_M decodes 1.2x faster than with the lean forward's ~40 torch ops and five kernel calls per layer.

**Row-invariant**: each output of a linear accumulates its products in its own register lane, k = 0, 1, 2, ... in
order, whatever the number of rows in the call or their tiling; then bias, then (bf16) rounding to nearest even. Each
(head, query) of attention is computed alone over the keys it sees, in slot order. So a token's projections and
attention are the same bits whether a forward carries it alone or among others, in a chain or in a tree: a
verification computes what plain decoding computes, and bf16 speculative decoding reproduces bf16 plain decoding
exactly. (oneDNN's GEMMs and SDPA are not: on SmolLM2 bf16 a row rounded differently from 8 rows on.) The summation
orders differ from oneDNN's, aten's and SDPA's, so outputs can differ from theirs in the last bits (float32: ~1e-7
relative; bf16: one unit in the last place, now and then).

Built on first use with the system C compiler (``$CC``, else ``cc`` / ``gcc``: `FLAGS`) into ``$CATS_CACHE/kernels``
(named by a hash of the source, the compiler and the CPU, so a rebuild happens only when one changes; ~2 s), and
loaded with ctypes; OpenMP resolves to the runtime torch already loaded, so the kernels share torch's threads.
Without a compiler, without AVX-512 (bf16: AVX512_BF16), off x86-64 Linux, or with ``CATS_KERNELS=0``,
`unavailable` says why and packed models use oneDNN and SDPA. ctypes releases the GIL while a kernel runs.
"""
from __future__ import annotations

import ctypes
import os
import platform
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from cats.model.kernels.native import build_library

PANEL = 48  # output rows per panel of the packed weight (the kernels' PANEL)
_KIND_BITS = {torch.bfloat16: 1, torch.float32: 2}  # cats_kernels()'s bits
SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")

KERNELS = {"off": os.environ.get("CATS_KERNELS", "1").strip().lower() in ("0", "false", "off", "no")}
# ``KERNELS["off"] = True`` keeps oneDNN for every call meanwhile (A/B timing in one process)

_LOCK = threading.Lock()
_STATE: dict = {}  # "library", "kinds", "reason" once the build was tried; then per dtype whether it runs, and the
# ctypes functions by (kind, dtype)


def _build() -> tuple[ctypes.CDLL | None, int, str | None]:
    """Compile (or find in the cache) and load the kernels: ``(library, kinds, None)`` or ``(None, 0, reason)``."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, 0, f"the kernels are x86-64 Linux only (this is {platform.system()} {platform.machine()})"

    library, reason = build_library(SOURCE, FLAGS, "avx512")
    if library is None:
        return None, 0, reason
    kinds = library.cats_kernels()
    pointer, size = ctypes.c_void_p, ctypes.c_long
    signatures = {"linear": [pointer] * 4 + [size] * 3 + [ctypes.c_int],
                  "attention": [pointer, size, size, pointer, pointer, size, size, pointer, size, pointer] + [size] * 5
                  + [ctypes.c_float, ctypes.c_int]}
    for kind, arguments in signatures.items():
        for suffix in ("bf16", "f32"):
            function = getattr(library, f"cats_{kind}_{suffix}", None)
            if function is not None:
                function.argtypes, function.restype = arguments, None
    if hasattr(library, "cats_layer"):
        spec = ctypes.POINTER(LayerSpec)
        library.cats_layer.argtypes = [spec, pointer, size, pointer, pointer, pointer, pointer, size, size, pointer,
                                       size, pointer, ctypes.c_int]
        library.cats_layer.restype = ctypes.c_int
        library.cats_layer_scratch.argtypes, library.cats_layer_scratch.restype = [spec, size], size
        library.cats_layers.argtypes = [size, pointer, pointer, size, pointer, pointer, pointer, pointer, pointer,
                                        pointer, pointer, pointer, pointer, ctypes.c_int, pointer]
        library.cats_layers.restype = ctypes.c_int
    if not kinds:
        return None, 0, "this CPU has no AVX-512"
    return library, kinds, None


def _library() -> tuple[ctypes.CDLL | None, int, str | None]:
    if "reason" not in _STATE:
        with _LOCK:
            if "reason" not in _STATE:
                library, kinds, reason = _build()
                _STATE.update(library=library, kinds=kinds, reason=reason)
    return _STATE["library"], _STATE["kinds"], _STATE["reason"]


def unavailable(dtype: torch.dtype) -> str | None:
    """None if the kernels can run ``dtype`` here (building them on first call), else why not."""
    if KERNELS["off"]:
        return "switched off (CATS_KERNELS=0)"
    if dtype not in _KIND_BITS:
        return f"no kernel for {dtype}"
    _, kinds, reason = _library()
    if reason is not None:
        return reason
    if not kinds & _KIND_BITS[dtype]:
        return f"this CPU has no kernel for {dtype} (bfloat16 needs AVX512_BF16)"
    return None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` in the kernels' panel layout (zero-padded): bf16 ``[ceil(N/48), ceil(K/2), 48, 2]``,
    float32 ``[ceil(N/48), K, 48]``."""
    rows, columns = weight.shape
    panels = -(-rows // PANEL)
    if weight.dtype == torch.bfloat16:
        padded = weight.new_zeros(panels * PANEL, columns + columns % 2)
        padded[:rows, :columns] = weight.detach()
        return padded.view(panels, PANEL, padded.shape[1] // 2, 2).transpose(1, 2).contiguous()
    padded = weight.new_zeros(panels * PANEL, columns)
    padded[:rows] = weight.detach()
    return padded.view(panels, PANEL, columns).transpose(1, 2).contiguous()


def _kernel(kind: str, dtype: torch.dtype):
    """The ctypes function ``cats_{kind}_{bf16|f32}`` (kept in `_STATE`: called for every linear of every forward)."""
    key = (kind, dtype)
    function = _STATE.get(key)
    if function is None:
        library, _, reason = _library()
        if library is None:
            raise RuntimeError(f"the AVX-512 kernels cannot run here: {reason}")
        function = _STATE[key] = getattr(library, f"cats_{kind}_{'bf16' if dtype == torch.bfloat16 else 'f32'}")
    return function


def linear(hidden: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``hidden @ W.T (+ bias)`` for ``hidden`` ``[..., K]``, with ``packed`` = `pack`\\ (W) (same dtype as ``hidden``)
    and ``bias`` a float32 vector or None (see `usable` for when to). (Kept lean: it runs for every linear of every
    forward, ~1 µs of Python around the kernel.)"""
    kernel = _kernel("linear", hidden.dtype)
    if not hidden.is_contiguous():
        hidden = hidden.contiguous()
    columns = hidden.shape[-1]
    out = hidden.new_empty(hidden.shape[:-1] + (out_features,))
    kernel(packed.data_ptr(), hidden.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
           hidden.numel() // columns if columns else 0, out_features, columns, torch.get_num_threads())
    return out


def _ready(dtype: torch.dtype) -> bool:
    """`unavailable` (dtype) is None, looked up once per dtype (the per-call checks of the hot path)."""
    if KERNELS["off"]:
        return False
    ready = _STATE.get(dtype)
    if ready is None:
        ready = _STATE[dtype] = unavailable(dtype) is None
    return ready


def usable(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a linear of ``weight`` on ``hidden`` should run on the kernels: CPU tensors of one dtype, no autograd,
    the kernels available for the dtype."""
    return (hidden.dtype == weight.dtype and _ready(weight.dtype) and hidden.is_cpu and hidden.dim() > 0
            and hidden.shape[-1] == weight.shape[1]
            and not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)))


ATTENTION_QUERY_LIMIT = 64  # queries per call of the attention and whole-layer kernels: a longer forward (a prompt, a
# large verification) runs in chunks of this many, so a token's result never depends on how many share its forward


def query_chunks(length: int, keys: int, mask: torch.Tensor | None):
    """``(first, last, seen)`` for each chunk of at most `ATTENTION_QUERY_LIMIT` of ``length`` new queries whose K/V
    are the last ``length`` of ``keys`` slots: queries ``first .. last - 1`` see the first ``seen`` slots (the new
    tokens up to ``last - 1`` and everything before them). A mask (``[length, keys]``, additive) that lets a query see
    a later new token cannot be split so: ValueError."""
    for first in range(0, length, ATTENTION_QUERY_LIMIT):
        last = min(first + ATTENTION_QUERY_LIMIT, length)
        seen = keys - length + last
        if seen < keys and mask is not None and bool((mask[first:last, seen:] > -1e30).any()):
            raise ValueError(f"the attention mask lets queries {first}..{last - 1} see later new tokens: only causal "
                             f"and tree masks (a token after its ancestors) run in chunks of {ATTENTION_QUERY_LIMIT}")
        yield first, last, seen


def attention_usable(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `attention` can run ``query`` ``[1, Hq, T, D]`` over ``key`` ``[1, Hk, S, D]`` here: CPU, one
    sequence, D a multiple of 32 up to 256 (bf16) or of 16 (float32), rows contiguous,
    a mask (or none only for one query), the kernels available for the dtype."""
    batch, heads, length, dim = query.shape
    return (batch == 1 and 1 <= length and query.is_cpu and query.dtype == key.dtype
            and dim <= 256 and dim % (32 if query.dtype == torch.bfloat16 else 16) == 0 and heads % key.shape[1] == 0
            and query.stride(-1) == 1 and key.stride(-1) == 1 and (mask is not None or length == 1)
            and _ready(query.dtype))


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """``softmax(scale * q k^T + mask) v`` for ``query`` ``[1, Hq, T, D]`` over ``key`` / ``value`` ``[1, Hk, S, D]``
    (grouped-query: head h reads KV head ``h // (Hq / Hk)``), ``mask`` float32 ``[T, S]`` (additive; values below
    -1e30 hide a key) or None (every key visible); returns ``[1, T, Hq * D]``, the layout the output projection
    reads. The queries' K/V are the last T keys; more than `ATTENTION_QUERY_LIMIT` queries run in chunks
    (`query_chunks`). Row-invariant (see ``avx512.c``); check `attention_usable` first."""
    kernel = _kernel("attention", query.dtype)
    _, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if value.stride() != key.stride():
        value = value.contiguous()
        key = key.contiguous()
    if mask is not None and (mask.dtype != torch.float32 or mask.stride(-1) != 1):
        mask = mask.to(torch.float32).contiguous()
    out = query.new_empty(1, length, heads * dim)
    for first, last, seen in query_chunks(length, keys, mask):
        kernel(query[:, :, first].data_ptr(), query.stride(1), query.stride(2), key.data_ptr(), value.data_ptr(),
               key.stride(1), key.stride(2), None if mask is None else mask[first].data_ptr(),
               0 if mask is None else mask.stride(0), out[:, first].data_ptr(), heads, kv_heads, last - first, seen,
               dim, scale, torch.get_num_threads())
    return out


class LayerSpec(ctypes.Structure):
    """One Llama-style decoder layer for `layer` (``struct cats_layer`` in ``avx512.c``): shapes, norm epsilons, the
    attention scale, and pointers to the norm weights, the packed panels of [q; k; v], o, [gate; up] and down, and
    their float32 biases (or NULL); or, with ``blocks`` (`cats.model.kernels.quantized.team_function`), the four
    linears as GGUF block groups (`quantized.GroupSpec`) and ``qk_order`` (int64, or NULL). Whoever builds one keeps
    what it points to alive."""

    _fields_ = [("bf16", ctypes.c_int), ("H", ctypes.c_long), ("Hq", ctypes.c_long), ("Hk", ctypes.c_long),
                ("D", ctypes.c_long), ("inter", ctypes.c_long), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float),
                ("scale", ctypes.c_float), ("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p),
                ("qkv", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p), ("o", ctypes.c_void_p),
                ("o_bias", ctypes.c_void_p), ("gate_up", ctypes.c_void_p), ("gate_up_bias", ctypes.c_void_p),
                ("down", ctypes.c_void_p), ("down_bias", ctypes.c_void_p), ("blocks", ctypes.c_void_p),
                ("qk_order", ctypes.c_void_p)]


def layer_ready(dtype: torch.dtype) -> bool:
    """Whether `layer` can run ``dtype`` here (the kernels built, with the whole-layer function)."""
    return _ready(dtype) and hasattr(_STATE.get("library"), "cats_layer")


_SCRATCH = threading.local()  # per thread: one byte buffer for the layer's intermediates, grown as needed


def layer(spec: LayerSpec, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
          values: torch.Tensor, past: int, mask: torch.Tensor | None) -> None:
    """One decoder layer (``spec``) on ``hidden`` ``[1, T, H]`` (contiguous; updated in place), T <=
    `ATTENTION_QUERY_LIMIT` (`query_chunks` splits longer forwards): the new tokens' K/V go to slots
    ``past .. past + T - 1`` of the layer's cache buffers ``keys``/``values`` ``[1, Hk, capacity, D]`` (contiguous,
    room checked by the caller), and attention reads slots ``[0, past + T)`` under ``mask`` (float32
    ``[T, past + T]``, or None for one query that sees every slot).
    ``cos``/``sin``: the rotary tables ``[1, T, D]`` in the model's dtype, contiguous. Same linears and attention as
    `linear` and `attention`, so row-invariant alike (see ``avx512.c``)."""
    library = _STATE["library"]
    length = hidden.shape[1]
    reference = ctypes.byref(spec)
    scratch = _scratch(library.cats_layer_scratch(reference, length))
    done = library.cats_layer(reference, hidden.data_ptr(), length, cos.data_ptr(), sin.data_ptr(),
                              keys.data_ptr(), values.data_ptr(), keys.stride(1), past,
                              None if mask is None else mask.data_ptr(), 0 if mask is None else mask.stride(0),
                              scratch.data_ptr(), torch.get_num_threads())
    _check_layer(done)


def layers(specs: Sequence[LayerSpec], hidden: torch.Tensor, rotaries: Sequence[tuple[torch.Tensor, torch.Tensor]],
           caches: Sequence[tuple[torch.Tensor, torch.Tensor, int]], masks: Sequence[torch.Tensor | None]) -> None:
    """`layer` for consecutive layers in one C call (no return to Python between them): layer i is ``specs[i]`` with
    its rotary ``(cos, sin)``, its cache ``(keys, values, past)`` and its mask, each as `layer` takes them, all on the
    same T <= `ATTENTION_QUERY_LIMIT` tokens. ValueError if one fails (the layers before it ran; the caller sets
    no cache length then)."""
    library = _STATE["library"]
    length, count = hidden.shape[1], len(specs)
    pointers = ctypes.c_void_p * count
    references = pointers(*(ctypes.addressof(spec) for spec in specs))
    scratch = _scratch(max(library.cats_layer_scratch(ctypes.byref(spec), length) for spec in specs))
    failed = ctypes.c_long(count)
    done = library.cats_layers(
        count, references, hidden.data_ptr(), length, pointers(*(cos.data_ptr() for cos, _ in rotaries)),
        pointers(*(sin.data_ptr() for _, sin in rotaries)), pointers(*(keys.data_ptr() for keys, _, _ in caches)),
        pointers(*(values.data_ptr() for _, values, _ in caches)),
        (ctypes.c_long * count)(*(keys.stride(1) for keys, _, _ in caches)),
        (ctypes.c_long * count)(*(past for _, _, past in caches)),
        pointers(*(None if mask is None else mask.data_ptr() for mask in masks)),
        (ctypes.c_long * count)(*(0 if mask is None else mask.stride(0) for mask in masks)),
        scratch.data_ptr(), torch.get_num_threads(), ctypes.byref(failed))
    _check_layer(done, f" (layer {failed.value} of the {count} in the call)")


def _scratch(needed: int) -> torch.Tensor:
    """This thread's scratch buffer for the layer kernels, grown to ``needed`` bytes."""
    scratch = getattr(_SCRATCH, "buffer", None)
    if scratch is None or scratch.numel() < needed:
        scratch = _SCRATCH.buffer = torch.empty(max(needed, 1 << 20), dtype=torch.uint8)
    return scratch


def _check_layer(done: int, where: str = "") -> None:
    if done != 0:
        raise ValueError(("the quantised kernels cannot multiply this layer's rows" if done == -1
                          else "out of memory in the quantised kernels") + where)
