"""Peak resident memory per method, from a background thread that samples the process RSS.

RSS is per process, so a method's peak includes everything resident while it ran: the shared target weights, and
for llama.cpp its own copy of the model once loaded. The sampler attributes each sample to the method running at
that moment; samples are also taken when a method starts and stops, so short runs are not missed entirely."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import psutil

MIB = 1 << 20


class PeakRssSampler:
    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.process = psutil.Process()
        self.peaks: dict[str, int] = {}  # method -> peak RSS in bytes
        self.current: str | None = None
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._sample_forever, name="cats-bench-rss", daemon=True)

    def __enter__(self) -> "PeakRssSampler":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()

    def _sample(self) -> None:
        rss = self.process.memory_info().rss
        with self.lock:
            if self.current is not None and rss > self.peaks.get(self.current, 0):
                self.peaks[self.current] = rss

    def _sample_forever(self) -> None:
        while not self.stopped.wait(self.interval_s):
            self._sample()

    @contextmanager
    def measuring(self, method: str):
        """Attribute the samples taken inside the block to ``method``."""
        with self.lock:
            self.current = method
        self._sample()
        try:
            yield
        finally:
            self._sample()
            with self.lock:
                self.current = None

    def peak_mb(self, method: str) -> float | None:
        peak = self.peaks.get(method)
        return round(peak / MIB, 1) if peak is not None else None
