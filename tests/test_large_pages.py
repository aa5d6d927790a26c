"""A memory-mapped model file faulted in through 2 MiB pages where the kernel can: which bytes can be, how the kernel's
account of them is read, and when the page cache is dropped and read again (once per kernel, not on every load)."""

from __future__ import annotations

import platform
import sys

import numpy as np
import pytest

from cats.model.weights import large_pages
from cats.model.weights.rss import page_cache_bytes

MIB = 1 << 20


def test_alignable_bytes_are_the_whole_2mib_pages_inside():
    assert large_pages.alignable_bytes(0, 8 * MIB) == 8 * MIB
    assert large_pages.alignable_bytes(4096, 8 * MIB) == 6 * MIB  # [2, 8) MiB: the first and last are cut
    assert large_pages.alignable_bytes(2 * MIB, 3 * MIB) == 2 * MIB
    assert large_pages.alignable_bytes(MIB, 2 * MIB) == 0


def test_large_page_bytes_sums_the_mappings_that_overlap(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "7f0000000000-7f0000400000 r--s 00000000 fe:00 1 /models/a.gguf\n"
        "Rss:                4096 kB\n"
        "FilePmdMapped:      4096 kB\n"
        "VmFlags: rd mr me ms hg \n"
        "7f0000400000-7f0000801000 r--s 00400000 fe:00 1 /models/a.gguf\n"  # the file's last page, past its end
        "FilePmdMapped:      2048 kB\n"
        "7f0000801000-7f0000c00000 rw-p 00000000 00:00 0 \n"  # someone else's memory after it
        "FilePmdMapped:      2048 kB\n"
    )
    start, size = 0x7F0000000000, 0x800800  # a file that ends inside its last 4 KiB page
    assert large_pages.large_page_bytes(start, size, smaps) == 6 * MIB
    assert large_pages.large_page_bytes(start + 0x400000, 4096, smaps) == 2 * MIB
    assert large_pages.large_page_bytes(start, size, tmp_path / "absent") is None


@pytest.fixture
def mapped_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(np.arange(6 * MIB, dtype=np.uint8).tobytes())
    data = np.memmap(path, dtype=np.uint8, mode="r")
    yield path, data
    del data


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's madvise and /proc/self/smaps")
def test_every_page_is_read_in(mapped_file):
    path, data = mapped_file
    result = large_pages.read_in_large_pages(path, data.ctypes.data, data.shape[0])
    assert result is not None and result.alignable_bytes <= data.shape[0]
    assert page_cache_bytes([path]) == data.shape[0]  # all of it in the cache, faulted in by the call
    assert result.large_bytes == large_pages.large_page_bytes(data.ctypes.data, data.shape[0])
    assert int(data[-1]) == (6 * MIB - 1) % 256  # the mapping still reads the file


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's madvise and /proc/self/smaps")
def test_small_pages_refill_the_cache_once_per_kernel(mapped_file, tmp_path, monkeypatch):
    """A kernel that never gives 2 MiB pages: the first load drops and rereads the cache, records that it did not
    help, and later loads on the same kernel leave the cache alone; another kernel tries again."""
    path, data = mapped_file
    monkeypatch.setattr(large_pages, "large_page_bytes", lambda address, size, smaps=None: 0)
    monkeypatch.setattr(large_pages, "transparent_huge_pages", lambda: True)
    dropped = []
    real_fadvise = large_pages.os.posix_fadvise
    monkeypatch.setattr(large_pages.os, "posix_fadvise",
                        lambda fd, offset, length, advice: (dropped.append(advice), real_fadvise(fd, offset, length, advice)))
    marker = tmp_path / "small-pages.json"
    first = large_pages.read_in_large_pages(path, data.ctypes.data, data.shape[0], marker)
    assert first.refilled and dropped == [large_pages.os.POSIX_FADV_DONTNEED]
    assert platform.release() in marker.read_text()
    again = large_pages.read_in_large_pages(path, data.ctypes.data, data.shape[0], marker)
    assert not again.refilled and len(dropped) == 1
    marker.write_text('{"kernel": "another"}')
    assert large_pages.read_in_large_pages(path, data.ctypes.data, data.shape[0], marker).refilled
    assert int(data[4096]) == 0  # still the file's bytes after the cache was dropped twice


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's madvise and /proc/self/smaps")
def test_without_transparent_huge_pages_the_cache_is_left_alone(mapped_file, tmp_path, monkeypatch):
    path, data = mapped_file
    monkeypatch.setattr(large_pages, "large_page_bytes", lambda address, size, smaps=None: 0)
    monkeypatch.setattr(large_pages, "THP_SETTING", tmp_path / "enabled")
    (tmp_path / "enabled").write_text("always madvise [never]\n")
    result = large_pages.read_in_large_pages(path, data.ctypes.data, data.shape[0], tmp_path / "marker.json")
    assert not result.refilled and not (tmp_path / "marker.json").exists()
    assert page_cache_bytes([path]) == data.shape[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's madvise and /proc/self/smaps")
def test_a_cache_partly_in_small_pages_is_refilled_without_giving_up(mapped_file, tmp_path, monkeypatch):
    """63 % in 2 MiB pages (another program filled part of the cache) is refilled; a refill that still leaves some
    small pages (pages another process maps stay) does not mark the kernel as giving none."""
    path, data = mapped_file
    alignable = large_pages.alignable_bytes(data.ctypes.data, data.shape[0])
    shares = iter([0.63, 0.5])
    monkeypatch.setattr(large_pages, "large_page_bytes", lambda address, size, smaps=None: int(next(shares) * alignable))
    monkeypatch.setattr(large_pages, "transparent_huge_pages", lambda: True)
    marker = tmp_path / "small-pages.json"
    result = large_pages.read_in_large_pages(path, data.ctypes.data, data.shape[0], marker)
    assert result.refilled and result.large_bytes == int(0.5 * alignable) and not marker.exists()
