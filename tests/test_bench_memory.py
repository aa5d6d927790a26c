"""`cats bench`'s peak memory per method: the kernel's high-water mark reset before each run, or sampling where the
kernel does not allow the reset."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from cats.bench import memory

MB = 1 << 20


def hold(megabytes: int, seconds: float = 0.0) -> None:
    block = np.ones(megabytes * MB // 8)  # every page written: resident
    time.sleep(seconds)
    del block


@pytest.mark.skipif(not sys.platform.startswith("linux") or not memory.reset_high_water_mark(),
                    reason="needs Linux's /proc/self/clear_refs")
def test_each_method_gets_its_own_peak_from_the_kernel():
    """A method that briefly held 200 MB reports it; one run after it that held nothing does not inherit it."""
    with memory.PeakRss() as rss:
        assert rss.thread is None  # no sampling thread on the methods' cores
        with rss.measuring("big"):
            hold(200)
        with rss.measuring("small"):
            hold(1)
    big, small = rss.peak_mb("big"), rss.peak_mb("small")
    assert big - small > 180
    assert "high-water mark" in memory.how_measured()


def test_without_the_reset_it_samples(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "CLEAR_REFS", tmp_path / "missing" / "clear_refs")
    assert not memory.reset_high_water_mark() and "sampled" in memory.how_measured()
    with memory.PeakRss(interval_s=0.002) as rss:
        assert rss.thread is not None
        with rss.measuring("big"):
            hold(200, seconds=0.1)
        with rss.measuring("small"):
            time.sleep(0.05)
    assert rss.peak_mb("big") - rss.peak_mb("small") > 180
