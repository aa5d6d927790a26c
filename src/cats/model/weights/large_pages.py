"""A memory-mapped model file's pages (Linux): read in through 2 MiB pages (`read_in_large_pages`), advised
(`madvise`), handed back (`release_pages`).

A decode step reads every resident weight once, so its speed is the memory's read bandwidth, and that depends on
the pages the file is mapped in. In 4 KiB pages a 1 GiB file takes 262144 page-table entries, and a sequential read
crosses a page boundary every 4 KiB, where the CPU's hardware prefetchers stop and a TLB miss walks the tables. In
2 MiB pages (one page-middle-directory entry each: ``FilePmdMapped`` in ``/proc/self/smaps``) the same reads run
faster: on the 2 vCPU AMD EPYC of docs/performance.md, two threads read Qwen2.5-Coder-1.5B's file at 31-36 GB/s
mapped that way against 26-28 GB/s in small pages, and a one-token decode step is 10-15 % faster.

Linux maps a file in 2 MiB pages where the mapping is 2 MiB aligned (it aligns large file mappings itself) and the
page cache holds the file in 2 MiB folios. Which folios the cache holds is decided by the reads that filled it:
faults in a mapping advised ``MADV_HUGEPAGE`` read a file on a filesystem with large folios (ext4, xfs, btrfs on
recent kernels) 2 MiB at a time, while a cache filled otherwise (``cp``, a checksum's ``read`` calls, an earlier
process's faults) keeps its small folios until the file leaves the cache. No call splits or merges a file's folios
in place (``MADV_COLLAPSE`` takes files only on kernels built with ``READ_ONLY_THP_FOR_FS``).

`read_in_large_pages` therefore advises the mapping ``MADV_HUGEPAGE``, faults every page in
(``MADV_POPULATE_READ``; llama.cpp maps its files with ``MAP_POPULATE`` likewise), and where less than 90 % of it
came out in 2 MiB pages (a cache filled partly by another program's reads: 63 % was seen after ``llama-server``
had run under a memory limit), hands its pages back, drops the file from the page cache (``POSIX_FADV_DONTNEED``:
pages other processes map stay) and faults it in again: one more read from storage, after which the cache holds the
file in 2 MiB folios for every later process. Where even that leaves next to no large pages (a filesystem, kernel
or setting without large folios), a marker next to the file's metadata says so, and later loads on the same
kernel do not drop the cache again.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import json
import mmap
import os
import platform
from dataclasses import dataclass
from pathlib import Path

LARGE_PAGE = 2 << 20
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_POPULATE_READ = 22  # Linux 5.14
REFILL_BELOW = 0.9  # below this share of 2 MiB pages the cache is dropped and read again
NONE_BELOW = 0.1  # below this share after that, the kernel gives the file no 2 MiB pages: marked, not tried again
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")

try:
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _LIBC.madvise.argtypes, _LIBC.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
except (OSError, AttributeError):  # no C library with madvise: pages are left to the kernel
    _LIBC = None


def madvise(address: int, length: int, advice: int) -> bool:
    """``madvise(2)`` on ``[address, address + length)``; False where it failed or there is no C library."""
    return _LIBC is not None and _LIBC.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice) == 0


def release_pages(path: Path, address: int, offset: int, length: int) -> None:
    """Hand the pages of bytes ``[offset, offset + length)`` of ``path``, mapped at ``address``, back to the kernel:
    unmapped from this process (``MADV_DONTNEED``; read again from the file if touched) and dropped from the page
    cache where no one else maps them (``POSIX_FADV_DONTNEED``). Only whole pages inside the range are unmapped."""
    page = mmap.PAGESIZE
    first = -(-(address + offset) // page) * page
    last = (address + offset + length) // page * page
    if last > first:
        madvise(first, last - first, mmap.MADV_DONTNEED)
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(descriptor, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


@dataclass(frozen=True)
class LargePages:
    """How a mapping came out: bytes in 2 MiB pages of the bytes that can be (the 2 MiB-aligned ones), and whether
    the page cache was dropped and read again for it."""

    large_bytes: int
    alignable_bytes: int
    refilled: bool

    @property
    def share(self) -> float:
        return self.large_bytes / self.alignable_bytes if self.alignable_bytes else 0.0


def alignable_bytes(address: int, size: int) -> int:
    """Bytes of ``[address, address + size)`` in whole 2 MiB-aligned pages."""
    first = -(-address // LARGE_PAGE) * LARGE_PAGE
    last = (address + size) // LARGE_PAGE * LARGE_PAGE
    return max(0, last - first)


def large_page_bytes(address: int, size: int, smaps: Path = Path("/proc/self/smaps")) -> int | None:
    """Bytes of ``[address, address + size)`` mapped in 2 MiB file pages (``FilePmdMapped`` of the mappings that
    overlap it: a mapping ends on a 4 KiB page, the file's last page may not); None where ``smaps`` cannot be
    read."""
    total, inside = 0, False
    try:
        with open(smaps) as handle:
            for line in handle:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    start, end = (int(value, 16) for value in head.split("-"))
                    inside = start < address + size and address < end
                elif inside and head == "FilePmdMapped:":
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return total


def transparent_huge_pages() -> bool:
    """Whether the kernel maps 2 MiB pages where asked (``always`` or ``madvise``)."""
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def _marked_small(marker: Path | None) -> bool:
    try:
        return marker is not None and json.loads(marker.read_text()).get("kernel") == platform.release()
    except (OSError, ValueError, AttributeError):
        return False


def _mark_small(marker: Path | None) -> None:
    if marker is None:
        return
    try:
        temporary = marker.with_name(f".{marker.name}.{os.getpid()}")
        temporary.write_text(json.dumps({"kernel": platform.release()}))
        os.replace(temporary, marker)
    except OSError:  # a read-only cache: tried again next time
        pass


def read_in_large_pages(path: Path, address: int, size: int, marker: Path | None = None) -> LargePages | None:
    """Fault in all of ``path`` mapped read-only at ``[address, address + size)``, in 2 MiB pages where the kernel
    can (see the module docstring); ``marker``: a file that records a kernel on which refilling the cache did not
    help. None where the kernel does not say how the mapping is held (no ``/proc``, no ``madvise``)."""
    madvise(address, size, MADV_HUGEPAGE)
    if not madvise(address, size, MADV_POPULATE_READ):
        return None
    large, alignable = large_page_bytes(address, size), alignable_bytes(address, size)
    if large is None or alignable == 0 or large >= REFILL_BELOW * alignable:
        return None if large is None else LargePages(large, alignable, refilled=False)
    if not transparent_huge_pages() or _marked_small(marker):
        return LargePages(large, alignable, refilled=False)
    release_pages(path, address, 0, size)  # unmapped here, so the cache can drop them
    madvise(address, size, MADV_POPULATE_READ)
    large = large_page_bytes(address, size) or 0
    if large < NONE_BELOW * alignable:
        _mark_small(marker)
    return LargePages(large, alignable, refilled=True)
