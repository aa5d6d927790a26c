"""Small-batch linears on AVX-512 CPUs: the projections of a forward over a few tokens, read at memory speed.

A decode step multiplies one token (verification: a few) by every weight of the model, so its time is the time to
stream the weights through the cores. oneDNN, the fastest library path torch offers here (`cats.model.lean`'s
prepacked weights), reads a SmolLM2 layer's small matrices at ~19 GB/s and pays ~17 µs per call, while this machine
streams memory at ~33 GB/s (docs/performance.md). The kernels in ``small_batch_linear.c`` close most of that gap for
up to `SMALL_BATCH_ROWS` rows: the weight is stored blocked, so one call reads it as one sequential stream, and each
of a few rows is multiplied with it while its block is in the core's cache (bf16 by ``vdpbf16ps`` with float32
accumulation, float32 by FMA). All of SmolLM2-135M's bf16 projections for one token: 6.8 ms against oneDNN's
12.3 ms (2 threads, same run); 4 rows 8.5 against 10.7; 8 rows equal; from 16 rows on oneDNN is faster, and stays in
use there.

**Row-invariant**: an output row is the same sequence of operations whatever the number of rows in the call (one
multiply-accumulate per chunk of 32 / 16 values into its own accumulator, then one horizontal sum, bias, rounding),
so a token's projections do not depend on how many tokens a forward carries, up to `SMALL_BATCH_ROWS`. bf16 results
are float32 sums rounded to nearest even, as oneDNN's are; the summation order differs from oneDNN's and aten's, so an
output can differ from theirs in the last bit (float32: ~1e-7 relative; bf16: one unit in the last place, rarely).

Built on first use with the system C compiler (``$CC``, else ``cc`` / ``gcc``: ``-O3 -march=native -fopenmp``) into
``$CATS_CACHE/kernels`` (named by a hash of the source, the compiler and the CPU, so a rebuild happens only when one
changes), and loaded with ctypes; OpenMP resolves to the runtime torch already loaded, so the kernels share torch's
threads. Without a compiler, without AVX-512 (bf16: AVX512_BF16), off CPUs, or with ``CATS_KERNELS=0``, `unavailable`
says why and callers keep oneDNN. No GIL is held while a kernel runs (ctypes releases it).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import torch

SMALL_BATCH_ROWS = 8  # up to this many rows the kernels run (SmolLM2 bf16, all projections: 8 rows on par with
# oneDNN, 16 rows 1.4x slower)
BLOCK_ROWS = 4  # weight rows per block (the kernels' ROWS)
CHUNK = {torch.bfloat16: 32, torch.float32: 16}  # values per chunk (one 512-bit vector)
_KIND_BITS = {torch.bfloat16: 1, torch.float32: 2}  # cats_linear_kernels()'s bits
SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

SMALL_BATCH = {"off": os.environ.get("CATS_KERNELS", "1").strip().lower() in ("0", "false", "off", "no")}
# ``SMALL_BATCH["off"] = True`` keeps oneDNN for every call meanwhile (A/B timing in one process)

_LOCK = threading.Lock()
_STATE: dict = {}  # "library", "kinds", "reason" once the build was tried


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU model and flags (Linux), else the platform's description."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _build() -> tuple[ctypes.CDLL | None, int, str | None]:
    """Compile (or find in the cache) and load the kernels: ``(library, kinds, None)`` or ``(None, 0, reason)``."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, 0, f"the kernels are x86-64 Linux only (this is {platform.system()} {platform.machine()})"
    compiler = _compiler()
    if compiler is None:
        return None, 0, "no C compiler found (set CC, or install gcc)"
    from cats.model.load import cache_root

    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return None, 0, f"cannot run {compiler}: {error}"
    digest = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(FLAGS).encode(),
                                        _cpu_identity().encode()])).hexdigest()[:16]
    folder = cache_root() / "kernels"
    target = folder / f"small_batch_linear-{digest}.so"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{target.name}.{os.getpid()}.tmp"
        try:
            done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(partial)], capture_output=True,
                                  text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as error:
            partial.unlink(missing_ok=True)
            return None, 0, f"compiling {SOURCE.name} failed: {error}"
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            detail = (done.stderr or done.stdout).strip().splitlines()
            return None, 0, f"compiling {SOURCE.name} failed: {detail[0] if detail else done.returncode}"
        os.replace(partial, target)  # atomic: a concurrent process sees the whole library or none
    try:
        library = ctypes.CDLL(str(target))
    except OSError as error:
        return None, 0, f"cannot load {target}: {error}"
    kinds = library.cats_linear_kernels()
    arguments = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    for name in ("cats_linear_bf16", "cats_linear_f32"):
        function = getattr(library, name, None)
        if function is not None:
            function.argtypes, function.restype = arguments, None
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
    if SMALL_BATCH["off"]:
        return "switched off (CATS_KERNELS=0)"
    if dtype not in CHUNK:
        return f"no kernel for {dtype}"
    _, kinds, reason = _library()
    if reason is not None:
        return reason
    if not kinds & _KIND_BITS[dtype]:
        return f"this CPU has no kernel for {dtype} (bfloat16 needs AVX512_BF16)"
    return None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` in the kernels' blocked layout ``[ceil(N/4), ceil(K/L), 4, L]`` (zero-padded)."""
    rows, columns = weight.shape
    chunk = CHUNK[weight.dtype]
    padded = weight.new_zeros(-(-rows // BLOCK_ROWS) * BLOCK_ROWS, -(-columns // chunk) * chunk)
    padded[:rows, :columns] = weight.detach()
    return padded.view(padded.shape[0] // BLOCK_ROWS, BLOCK_ROWS, padded.shape[1] // chunk,
                       chunk).transpose(1, 2).contiguous()


def linear(hidden: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``hidden @ W.T (+ bias)`` for ``hidden`` ``[..., K]`` of at most `SMALL_BATCH_ROWS` rows, with ``packed`` =
    `pack`\\ (W) (same dtype as ``hidden``) and ``bias`` a float32 vector or None. The caller checks `unavailable`."""
    library = _STATE["library"]
    hidden = hidden.contiguous()
    columns = hidden.shape[-1]
    rows = hidden.numel() // columns
    out = hidden.new_empty(*hidden.shape[:-1], out_features)
    kernel = library.cats_linear_bf16 if hidden.dtype == torch.bfloat16 else library.cats_linear_f32
    kernel(packed.data_ptr(), hidden.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), rows,
           out_features, columns, torch.get_num_threads())
    return out


def usable(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a linear of ``weight`` on ``hidden`` should run here: a CPU tensor of the weight's dtype, at most
    `SMALL_BATCH_ROWS` rows, no autograd, and the kernels available for the dtype."""
    return (hidden.dtype == weight.dtype and hidden.device.type == "cpu" and hidden.dim() > 0
            and hidden.numel() <= SMALL_BATCH_ROWS * hidden.shape[-1] and hidden.shape[-1] == weight.shape[1]
            and not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad))
            and unavailable(weight.dtype) is None)
