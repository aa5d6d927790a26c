"""Peak resident memory per method, as the kernel counts it.

Where Linux allows it, the kernel keeps the figure itself: before each run of a method the process's peak resident
set is reset (writing 5 to ``/proc/self/clear_refs``) and after it ``VmHWM`` from ``/proc/self/status`` is read,
so every page that was resident at any moment counts, however briefly. Elsewhere a background thread samples the
RSS every 5 ms instead; that thread wakes 200 times a second on the cores the methods compute on (a 96-token Qwen2.5
generation on 2 cores took 3 % longer with it running), so it is only the fallback.

RSS is per process, so a method's peak includes everything resident while it ran: the shared target weights, and
for llama.cpp its own copy of the model once loaded (that server's own peak is read from its process)."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

import psutil

MIB = 1 << 20
CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")


def high_water_mark() -> int | None:
    """This process's peak resident set since it started or since the last reset (``VmHWM``), in bytes; None where
    the kernel does not report it."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def reset_high_water_mark() -> bool:
    """Set the peak resident set back to the current one; False where the kernel does not allow it."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return high_water_mark() is not None


def how_measured(interval_s: float = 0.005) -> str:
    """How `PeakRss` measures here."""
    return ("the kernel's high-water mark (VmHWM) over each method's runs, reset before each" if reset_high_water_mark()
            else f"RSS sampled every {interval_s * 1000:.0f} ms while each method ran")


class PeakRss:
    """``with PeakRss() as rss: with rss.measuring(name): ...``, then ``rss.peak_mb(name)``: the highest resident
    set seen inside any ``measuring(name)`` block (`how_measured` says how)."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.kernel = reset_high_water_mark()
        self.process = psutil.Process()
        self.peaks: dict[str, int] = {}  # method -> peak RSS in bytes
        self.current: str | None = None
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = None if self.kernel else threading.Thread(target=self._sample_forever, name="cats-bench-rss",
                                                                 daemon=True)

    def __enter__(self) -> "PeakRss":
        if self.thread is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.thread is not None:
            self.stopped.set()
            self.thread.join()

    def _note(self, method: str, rss: int) -> None:
        with self.lock:
            if rss > self.peaks.get(method, 0):
                self.peaks[method] = rss

    def _sample(self) -> None:
        method = self.current
        if method is not None:
            self._note(method, self.process.memory_info().rss)

    def _sample_forever(self) -> None:
        while not self.stopped.wait(self.interval_s):
            self._sample()

    @contextmanager
    def measuring(self, method: str):
        """Attribute the peak inside the block to ``method``."""
        if self.kernel:
            reset_high_water_mark()
        else:
            self.current = method
            self._sample()
        try:
            yield
        finally:
            if self.kernel:
                peak = high_water_mark()
                if peak is not None:
                    self._note(method, peak)
            else:
                self._sample()
                self.current = None

    def peak_mb(self, method: str) -> float | None:
        peak = self.peaks.get(method)
        return round(peak / MIB, 1) if peak is not None else None
