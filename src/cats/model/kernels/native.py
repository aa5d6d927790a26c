"""Building CATS's small C libraries: compiled on first use with the system C compiler (``$CC``, else ``cc`` /
``gcc``) into ``$CATS_CACHE/kernels``, named by a hash of the source, the compiler, the flags and the CPU (so a
rebuild happens only when one of them changes), and loaded with ctypes (which releases the GIL while a C function
runs)."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from cats.paths import cache_root


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU model and flags (Linux), else the platform's description."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def build_library(source: Path, flags: tuple[str, ...], prefix: str) -> tuple[ctypes.CDLL | None, str | None]:
    """Compile ``source`` with ``flags`` (or find it in the cache) and load it: ``(library, None)``, or
    ``(None, why not)``."""
    cc = compiler()
    if cc is None:
        return None, "no C compiler found (set CC, or install gcc)"

    text = Path(source).read_bytes()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"cannot run {cc}: {error}"
    digest = hashlib.sha256(b"\0".join([text, version.encode(), " ".join(flags).encode(),
                                        cpu_identity().encode()])).hexdigest()[:16]
    folder = cache_root() / "kernels"
    target = folder / f"{prefix}-{digest}.so"
    if not target.exists():
        partial = folder / f".{target.name}.{os.getpid()}.tmp"
        print(f"cats: compiling {Path(source).name} for this CPU, once; cached in {target}", file=sys.stderr, flush=True)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            done = subprocess.run([cc, *flags, str(source), "-o", str(partial)], capture_output=True, text=True,
                                  timeout=300)
            if done.returncode != 0:
                detail = (done.stderr or done.stdout).strip().splitlines()
                return None, f"compiling {Path(source).name} failed: {detail[0] if detail else done.returncode}"
            os.replace(partial, target)  # atomic: a concurrent process sees the whole library or none
        except (OSError, subprocess.SubprocessError) as error:
            return None, f"building {Path(source).name} in {folder} failed: {error}"
        finally:
            with contextlib.suppress(OSError):
                partial.unlink()
    try:
        return ctypes.CDLL(str(target)), None
    except OSError as error:
        return None, f"cannot load {target}: {error}"
