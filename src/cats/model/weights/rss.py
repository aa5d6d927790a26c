"""Measuring memory as the operating system sees it (Linux).

* Peak RSS: ``VmHWM`` of ``/proc/self/status``, the high-water mark of the resident set (anonymous memory, plus
  file pages the process has mapped). Writing ``5`` to ``/proc/self/clear_refs`` resets it to the current RSS,
  so a phase's peak can be taken alone (`reset_peak_rss`).
* The page cache is not in RSS for files read with ``pread``: `page_cache_bytes` asks the kernel (``mincore`` on
  a temporary mapping) how many bytes of given files it holds in its cache, so memory the kernel keeps for a
  method's reads is reported too.
* Freed memory that stays in the process: glibc serves allocations below its mmap threshold from its heaps and
  keeps freed heap memory; the threshold grows on its own (up to 32 MiB) after large blocks are freed, so after a
  few decode steps every activation comes from the heap and the RSS only grows. `bound_heap` fixes the threshold
  at 1 MiB (blocks of 1 MiB or more get their own mapping and go back to the OS when freed); a model put under a
  budget calls it.
* Bytes read from storage: ``read_bytes`` of ``/proc/self/io`` (reads served by the page cache are not in it).
* The runtime baseline: the peak RSS of a fresh process that imports torch, transformers and CATS, reads the
  tokenizer, builds the model skeleton with every weight on the meta device, and runs one small matrix product and
  one small attention call on random 64-wide tensors with the run's thread count (torch's kernels and thread pool
  set themselves up on first use): everything but weights, KV cache and activations (`runtime_baseline`, run as
  ``python -m cats.model.weights.baseline MODEL THREADS``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import mmap
import os
import subprocess
import sys

from cats.paths import IMPORT_ROOT

MIB = 1 << 20


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_rss_bytes() -> int | None:
    """The process's peak resident set (``VmHWM``) in bytes; None where /proc is not available."""
    kib = _status_kib("VmHWM")
    return kib * 1024 if kib is not None else None


def current_rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else None


def anonymous_rss_bytes() -> int | None:
    """The process's resident anonymous memory (``RssAnon`` + ``RssShmem``): what the kernel cannot reclaim without
    swap. Its resident file pages (libraries, mapped files) are left out: under a memory limit the kernel drops the
    cold ones and reads them again if touched (counted as major faults)."""
    anon, shmem = _status_kib("RssAnon"), _status_kib("RssShmem")
    return (anon + (shmem or 0)) * 1024 if anon is not None else None


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def storage_read_bytes(pid: int | str = "self") -> int | None:
    """Bytes a process (this one by default) caused to be read from storage (``/proc/PID/io`` ``read_bytes``)."""
    try:
        with open(f"/proc/{pid}/io") as handle:
            for line in handle:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


_libc = None


def _mincore():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return _libc


def page_cache_bytes(paths) -> int:
    """Bytes of these files that the kernel holds in its page cache (``mincore``); mapping a file to ask does not
    read it."""
    libc, page, total = _mincore(), mmap.PAGESIZE, 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                continue
            try:
                pages = (size + page - 1) // page
                vector = (ctypes.c_ubyte * pages)()
                if libc.mincore(ctypes.c_void_p(address), size, vector) == 0:
                    total += sum(v & 1 for v in vector) * page
            finally:
                libc.munmap(ctypes.c_void_p(address), size)
        finally:
            os.close(fd)
    return total


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_freed_memory() -> bool:
    """Collect Python's garbage and hand the C heap's free pages back to the kernel (glibc's ``malloc_trim``), so
    that memory freed while loading (a tokenizer's JSON, say) is not charged to the process; False where the C
    library is not glibc (nothing is returned)."""
    gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def bound_heap(threshold: int = 1 << 20) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes (see the module docstring); False where the C library is not
    glibc (nothing changes)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1


def evict_page_cache(paths) -> None:
    """Ask the kernel to drop these files from its page cache (``POSIX_FADV_DONTNEED``; clean pages only)."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def runtime_baseline(model: str, threads: int | None = None, timeout_s: float = 300) -> dict:
    """Measure the runtime baseline of ``model`` in a fresh process: ``{"peak_rss_mb", "rss_mb"}``."""
    environment = dict(os.environ)
    source = str(IMPORT_ROOT)
    environment["PYTHONPATH"] = source + os.pathsep + environment.get("PYTHONPATH", "")
    command = [sys.executable, "-m", "cats.model.weights.baseline", model] + ([str(threads)] if threads else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=environment)
    if done.returncode != 0:
        raise RuntimeError(f"measuring the runtime baseline failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
