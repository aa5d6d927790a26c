"""Building CATS's small C libraries: compiled on first use with the system C compiler (``$CC``, else ``cc`` /
``gcc``) into ``$CATS_CACHE/kernels``, named by a hash of the source, the compiler, the flags and the CPU (so a
rebuild happens only when one of them changes), and loaded with ctypes (which releases the GIL while a C function
runs). Each library lives in its own folder, ``<prefix>-<hash>/<prefix>.so``, beside ``record.json``, its size,
modification time and CRC-32 (`cats.cache_files`); a library that does not match it (overwritten, truncated,
missing) is compiled again before it is loaded, with a one-line notice on stderr: a damaged library is never
loaded."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from cats.cache_files import Damaged, check_folder, clean_stale, discard, notice, staging_folder, write_record
from cats.paths import cache_root

RECORD = "record.json"  # beside each library: its size, modification time and CRC-32


class CompileError(Exception):
    """The compiler refused the source (the message says why)."""


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
    folder = cache_root() / "kernels" / f"{prefix}-{digest}"
    target = folder / f"{prefix}.so"
    if not _verified(folder):
        notice(f"compiling {Path(source).name} for this CPU, once; cached in {target}")
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            with staging_folder(folder) as staging:  # atomic: a concurrent process sees the whole library or none
                done = subprocess.run([cc, *flags, str(source), "-o", str(staging / target.name)], capture_output=True,
                                      text=True, timeout=300)
                if done.returncode != 0:
                    detail = (done.stderr or done.stdout).strip().splitlines()
                    raise CompileError(f"compiling {Path(source).name} failed: {detail[0] if detail else done.returncode}")
                write_record(staging, RECORD, {"source": str(source), "flags": list(flags)})
        except CompileError as error:
            return None, str(error)
        except (OSError, subprocess.SubprocessError, Damaged) as error:
            return None, f"building {Path(source).name} in {folder.parent} failed: {error}"
    try:
        return ctypes.CDLL(str(target)), None
    except OSError as error:
        return None, f"cannot load {target}: {error}"


def _verified(folder: Path) -> bool:
    """Whether the library folder ``folder`` is in the cache and matches its record; a damaged one is removed,
    with a notice."""
    clean_stale(folder.parent)
    try:
        check_folder(folder, RECORD)
        return True
    except FileNotFoundError:
        return False
    except Damaged as damage:
        notice(f"the compiled library in {folder} is damaged: {damage}; compiling it again")
        discard(folder)
        return False
