"""Linears on a GGUF file's own quantised blocks: the weights stay in the bytes the file stores (memory-mapped), and
every decode step reads them as they are.

A decode step reads every weight of the model once, so its time is the time to stream the weights through the
cores: a Q4_K weight is 4.5 bits, a float32 one 32. Neither torch nor oneDNN multiplies GGUF blocks (torch's int4
kernels take their own packed layout and per-group scales, not the file's), and llama.cpp's own kernels are not a
library CATS can call on its tensors, so these are written here (``quantized.c``): one kernel per block family
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; Q4_K, Q5_K, Q6_K; F16, BF16, F32), reading each row of the file's tensor in place.

**Activations are quantised to 8 bits for the dot products**, as llama.cpp does: each token's input row in blocks of
256 values (k-quants) or 32 (the rest), one float scale per block (max |x| / 127). The integer products within a block
are exact; blocks are scaled and summed in float32 (on AVX-512 the k-quants per int32 lane: each lane holds values
of one sub-block, so a block of 256 values is 4 ``vpdpbusd`` and its sub-block scales are applied in float). The results therefore differ from the dequantised float path
(`--kernels aten`: the same weights dequantised to float32, float activations) by the rounding of the activations;
docs/benchmarks.md reports how often greedy answers agree. F16, BF16 and F32 rows are multiplied in float32.

**Row-invariant**: each token's row is quantised alone, and each output is one thread's fixed sequence of operations
whatever the number of tokens in the call (see ``quantized.c``): speculative decoding on these kernels reproduces
plain decoding on them bit for bit.

**Instruction sets**: the source is compiled for AMX (AVX-512 plus the tile instructions, ``tdpbusd``), for AVX-512
(BW, VL, VNNI: ``vpdpwssd`` / ``vpdpbusd``) and for AVX2 (``vpmaddubsw`` / ``vpmaddwd``), and each build is first run
once in a child process, which dies instead of this one if the CPU cannot run it (a CPU may list an instruction set
it traps on). The first build that runs, in that order, is used; ``CATS_QUANTIZED_ISA=amx|avx512|avx2`` forces one
(tests force each). Linux lends the tile registers to a process only when asked (``arch_prctl``), which the AMX build
does (its check fails where the request is refused); its tiles multiply 8 or more tokens' Q4_K / Q5_K rows at once
(prompts, large verifications), and to stay row-invariant its vectors then sum each of those blocks' lanes to one
integer (docs/performance.md has the measurements). Without a C compiler, off x86-64 Linux, or with
``CATS_KERNELS=0``, `unavailable` says why and GGUF files are loaded dequantised instead (`cats.model.source`).
"""
from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
import threading
from pathlib import Path

import torch

from cats.model.kernels.native import build_library

SOURCE = Path(__file__).with_suffix(".c")
COMMON = ("-O3", "-mfma", "-mf16c", "-fopenmp", "-Werror=implicit-function-declaration", "-shared", "-fPIC")
AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", *COMMON)
ISAS = {  # instruction set -> its compiler flags, in the order tried when none is named
    "amx": (*AVX512, "-mamx-tile", "-mamx-int8", "-DCATS_AMX"),
    "avx512": AVX512,
    "avx2": ("-mavx2", *COMMON),
}
TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13,
         "Q6_K": 14, "BF16": 30}  # ggml's type codes, which GGUF files store
BLOCK_VALUES = {0: 1, 1: 1, 30: 1, 2: 32, 3: 32, 6: 32, 7: 32, 8: 32, 12: 256, 13: 256, 14: 256}
TYPE_NAMES = {code: name for name, code in TYPES.items()}

_LOCK = threading.Lock()
_STATE: dict = {}  # per instruction set: (library, None) or (None, why not); "chosen": the one in use


def _probe(path: str) -> str | None:
    """Run the library at ``path`` once in a child process: None if it ran, else why not."""
    code = "import ctypes, sys; sys.exit(ctypes.CDLL(sys.argv[1]).cats_quantized_probe() != 0)"
    try:
        done = subprocess.run([sys.executable, "-c", code, path], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        return f"cannot run a check of it: {error}"
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        return f"this CPU cannot run it (signal {-done.returncode})"
    return f"its check failed (exit {done.returncode})"


def _load(isa: str) -> tuple[ctypes.CDLL | None, str | None]:
    """The library built for ``isa``, checked once by `_probe`: ``(library, None)`` or ``(None, why not)``."""
    if isa not in _STATE:
        with _LOCK:
            if isa not in _STATE:
                library, reason = build_library(SOURCE, ISAS[isa], f"quantized-{isa}")
                if library is not None:
                    reason = _probe(library._name)
                if reason is None:
                    function = library.cats_quantized_linear
                    function.argtypes = [ctypes.c_int] + [ctypes.c_void_p] + [ctypes.c_long] + [ctypes.c_void_p] * 3 \
                        + [ctypes.c_long] * 3 + [ctypes.c_int]
                    function.restype = ctypes.c_int
                    several = library.cats_quantized_linears
                    several.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 7 + [ctypes.c_long] * 2 + [ctypes.c_int]
                    several.restype = ctypes.c_int
                    rows = library.cats_quantized_rows
                    rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                     ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
                    rows.restype = ctypes.c_int
                _STATE[isa] = (library if reason is None else None, reason)
    return _STATE[isa]


def _platform_reason() -> str | None:
    if os.environ.get("CATS_KERNELS", "1").strip().lower() in ("0", "false", "off", "no"):
        return "switched off (CATS_KERNELS=0)"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the kernels are x86-64 Linux only (this is {platform.system()} {platform.machine()})"
    return None


def choose(isa: str | None = None) -> tuple[str | None, str | None]:
    """The instruction set the kernels run with: ``(isa, None)``, or ``(None, why none)``. ``isa`` (or
    ``$CATS_QUANTIZED_ISA``) names one to use; otherwise the best one that runs here."""
    reason = _platform_reason()
    if reason is not None:
        return None, reason
    wanted = isa or os.environ.get("CATS_QUANTIZED_ISA", "").strip().lower() or None
    if wanted is not None and wanted not in ISAS:
        return None, f"unknown instruction set {wanted!r} (CATS_QUANTIZED_ISA: one of {', '.join(ISAS)})"
    reasons = []
    for name in [wanted] if wanted else list(ISAS):
        library, why = _load(name)
        if library is not None:
            return name, None
        reasons.append(f"{name}: {why}")
    return None, "; ".join(reasons)


def unavailable() -> str | None:
    """None if the kernels run here (building and checking them on first call), else why not."""
    if "chosen" not in _STATE:
        _STATE["chosen"] = choose()
    return _STATE["chosen"][1]


def isa() -> str | None:
    """The instruction set in use (None: the kernels do not run here)."""
    unavailable()
    return _STATE["chosen"][0]


def use(name: str | None) -> None:
    """Run the kernels with instruction set ``name`` from now on (None: choose again), e.g. to test each path."""
    _STATE["chosen"] = choose(name)
    if _STATE["chosen"][0] is None:
        raise RuntimeError(f"the {name} kernels cannot run here: {_STATE['chosen'][1]}")


def supports(type_code: int, columns: int) -> bool:
    """Whether the kernels multiply a tensor of GGUF type ``type_code`` with rows of ``columns`` values."""
    block = BLOCK_VALUES.get(type_code)
    return block is not None and columns % block == 0


def _library_in_use():
    chosen = _STATE.get("chosen")
    if chosen is None or chosen[0] is None:
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(f"the quantised kernels cannot run here: {reason}")
    return _STATE[_STATE["chosen"][0]][0]


class GroupSpec(ctypes.Structure):
    """``struct cats_group`` (``quantized.c``): several linears on one input, as `team_function` takes them."""

    _fields_ = [("count", ctypes.c_int), ("types", ctypes.c_void_p), ("W", ctypes.c_void_p),
                ("row_bytes", ctypes.c_void_p), ("N", ctypes.c_void_p), ("biases", ctypes.c_void_p),
                ("K", ctypes.c_long)]


class Group:
    """Several linears that read the same input (q, k and v; gate and up), for `linears`: their rows, types and
    biases as the C function takes them (the tensors are kept alive here); ``spec`` is the same as a
    ``struct cats_group`` for `team_function`."""

    def __init__(self, parts: list[tuple[torch.Tensor, int, torch.Tensor | None]], columns: int):
        self.parts, self.columns = parts, columns
        count = len(parts)
        self.count, self.rows = count, sum(blocks.shape[0] for blocks, _, _ in parts)
        self.types = (ctypes.c_int * count)(*[code for _, code, _ in parts])
        self.pointers = (ctypes.c_void_p * count)(*[blocks.data_ptr() for blocks, _, _ in parts])
        self.row_bytes = (ctypes.c_long * count)(*[blocks.stride(0) for blocks, _, _ in parts])
        self.sizes = (ctypes.c_long * count)(*[blocks.shape[0] for blocks, _, _ in parts])
        self.biases = (ctypes.c_void_p * count)(*[None if bias is None else bias.data_ptr() for _, _, bias in parts])
        address = ctypes.addressof
        self.spec = GroupSpec(count, address(self.types), address(self.pointers), address(self.row_bytes),
                              address(self.sizes), address(self.biases), columns)


def team_function() -> int:
    """The address of ``cats_quantized_team`` in the build in use: a group's linears computed by every thread of the
    caller's OpenMP team (the whole-layer kernel, `cats.model.kernels.avx512.layer`, calls it for its linears)."""
    return ctypes.cast(_library_in_use().cats_quantized_team, ctypes.c_void_p).value


def linears(hidden: torch.Tensor, group: Group) -> torch.Tensor:
    """The linears of ``group`` on ``hidden`` ``[..., columns]`` side by side, ``[..., sum of their rows]``, in one
    call: the input is quantised once and one thread team covers every row."""
    library = _library_in_use()
    if hidden.dtype != torch.float32:
        hidden = hidden.to(torch.float32)
    if not hidden.is_contiguous():
        hidden = hidden.contiguous()
    out = hidden.new_empty(hidden.shape[:-1] + (group.rows,))
    columns = group.columns
    done = library.cats_quantized_linears(group.count, group.types, group.pointers, group.row_bytes, group.sizes,
                                          group.biases, hidden.data_ptr(), out.data_ptr(),
                                          hidden.numel() // columns if columns else 0, columns,
                                          torch.get_num_threads())
    if done != 0:
        raise ValueError("the quantised kernels cannot multiply these rows" if done == -1
                         else "out of memory in the quantised kernels")
    return out


def linear(hidden: torch.Tensor, blocks: torch.Tensor, type_code: int, columns: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``hidden @ W.T (+ bias)`` in float32 for ``hidden`` ``[..., columns]`` (float32) and W the rows of ``blocks``
    (uint8 ``[N, row bytes]``, a GGUF tensor's rows as stored, type ``type_code``); ``bias`` float32 or None."""
    library = _library_in_use()
    if hidden.dtype != torch.float32:
        hidden = hidden.to(torch.float32)
    if not hidden.is_contiguous():
        hidden = hidden.contiguous()
    rows = blocks.shape[0]
    out = hidden.new_empty(hidden.shape[:-1] + (rows,))
    done = library.cats_quantized_linear(type_code, blocks.data_ptr(), blocks.stride(0), hidden.data_ptr(),
                                         None if bias is None else bias.data_ptr(), out.data_ptr(),
                                         hidden.numel() // columns if columns else 0, rows, columns,
                                         torch.get_num_threads())
    if done != 0:
        raise ValueError(f"the quantised kernels cannot multiply {TYPE_NAMES.get(type_code, type_code)} rows of "
                         f"{columns} values" if done == -1 else "out of memory in the quantised kernels")
    return out


def dequantized_rows(blocks: torch.Tensor, type_code: int, columns: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``rows`` (int64 row numbers; None: all) of ``blocks`` (uint8 ``[N, row bytes]``, type ``type_code``) as
    float32 ``[n, columns]``: the values gguf-py's dequantisation gives, bit for bit, without its numpy overhead."""
    library = _library_in_use()
    if rows is not None:
        rows = rows.reshape(-1).to(torch.int64).contiguous()
    count = blocks.shape[0] if rows is None else rows.numel()
    out = torch.empty(count, columns, dtype=torch.float32)
    done = library.cats_quantized_rows(type_code, blocks.data_ptr(), blocks.stride(0), blocks.shape[0],
                                       None if rows is None else rows.data_ptr(), count, columns, out.data_ptr())
    if done == -1:
        raise ValueError(f"the quantised kernels do not take {TYPE_NAMES.get(type_code, type_code)} rows of {columns}")
    if done == -2:
        raise IndexError(f"row numbers outside [0, {blocks.shape[0]})")
    return out
