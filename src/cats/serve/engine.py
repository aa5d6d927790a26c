"""One model, one decode at a time (batch size 1).

Requests take the `GenerationSlot` in arrival order; at most ``max_queue`` wait for it, one more is refused
(`QueueFullError`, HTTP 429). The slot holder decodes on a worker thread with `Generator.stream`, which yields
after every target forward; each chunk of committed tokens is handed to the event loop, and a cancelled run
(the client went away) stops at the next chunk and frees the slot."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Sequence

from cats.config import GenerationConfig
from cats.loop.generator import Generator
from cats.loop.stats import GenerationStats


class QueueFullError(Exception):
    """The slot is taken and ``max_queue`` requests already wait for it."""


class ShuttingDownError(Exception):
    """The server is shutting down and takes no more requests."""


class GenerationSlot:
    """A lock with a bounded first-come-first-served queue of waiters."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self.busy = False
        self.closed = False
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Take the slot, waiting behind earlier requests; raise `QueueFullError` at once if the queue is full,
        `ShuttingDownError` once the slot is closed."""
        if self.closed:
            raise ShuttingDownError("the server is shutting down")
        if not self.busy:
            self.busy = True
            return
        if len(self._waiters) >= self.max_queue:
            raise QueueFullError(f"the server is busy: {len(self._waiters)} requests are already waiting")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed the slot just as we gave up: pass it on
                self.release()
            else:
                self._waiters.remove(waiter)
            raise

    def close(self) -> None:
        """Take no more requests; those waiting get `ShuttingDownError`."""
        self.closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(ShuttingDownError("the server is shutting down"))

    def release(self) -> None:
        """Hand the slot to the longest waiter, or free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.busy = False


class Run:
    """One generation on the worker thread. Its chunks of committed tokens arrive through `chunks`."""

    def __init__(self, prompt_ids: Sequence[int], config: GenerationConfig, queue_s: float):
        self.prompt_ids = list(prompt_ids)
        self.config = config
        self.queue_s = queue_s  # seconds spent waiting for the slot
        self.stats = GenerationStats()
        self.cancelled = threading.Event()
        self.outcome = ""  # once finished: completed, cancelled or failed
        self.events: asyncio.Queue = asyncio.Queue()

    def cancel(self) -> None:
        """Stop decoding after the current target forward (no-op once finished)."""
        self.cancelled.set()

    async def chunks(self) -> AsyncIterator[list[int]]:
        """The committed tokens, a chunk per target forward; re-raises an error of the decode loop."""
        while True:
            kind, value = await self.events.get()
            if kind == "tokens":
                yield value
            elif kind == "error":
                raise value
            else:
                self.outcome = value
                return


class Engine:
    """Serves generations from one `Generator`, one at a time, in arrival order."""

    def __init__(self, generator: Generator, max_queue: int = 8):
        self.generator = generator
        self.model = generator.model
        self.slot = GenerationSlot(max_queue)
        self.counts: Counter[str] = Counter()  # finished runs by outcome: completed, cancelled, failed
        self.active: Run | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's event loop, once started
        self._mean_run_s = 1.0  # running mean of how long a run holds the slot, for Retry-After

    @property
    def max_queue(self) -> int:
        return self.slot.max_queue

    def retry_after(self) -> int:
        """Seconds after which a refused request may find room: the queue ahead of it at the mean run time."""
        return max(1, math.ceil(self._mean_run_s * (self.slot.queued + 1)))

    async def start(self, prompt_ids: Sequence[int], config: GenerationConfig) -> Run:
        """Wait for the slot (or raise `QueueFullError`), then start decoding on a worker thread."""
        queued_at = time.perf_counter()
        await self.slot.acquire()
        run = Run(prompt_ids, config, time.perf_counter() - queued_at)
        self.active = run
        loop = asyncio.get_running_loop()
        try:
            threading.Thread(target=self._work, args=(run, loop), name="cats-generate", daemon=True).start()
        except BaseException:
            self._finished(run, "failed", 0.0)
            raise
        return run

    def _work(self, run: Run, loop: asyncio.AbstractEventLoop) -> None:
        started, outcome, failure = time.perf_counter(), "completed", None
        stream = self.generator.stream(run.prompt_ids, run.config, run.stats)
        try:
            if run.cancelled.is_set():
                outcome = "cancelled"
            else:
                for chunk in stream:
                    if run.cancelled.is_set():
                        outcome = "cancelled"
                        break
                    _post(loop, run.events.put_nowait, ("tokens", chunk))
        except Exception as error:  # reported to the client; the server goes on
            outcome, failure = "failed", error
        finally:
            stream.close()
            # free the slot before the client hears the end, so that its next request finds it free
            _post(loop, self._finished, run, outcome, time.perf_counter() - started)
            if failure is not None:
                _post(loop, run.events.put_nowait, ("error", failure))
            _post(loop, run.events.put_nowait, ("end", outcome))

    def _finished(self, run: Run, outcome: str, seconds: float) -> None:
        self.counts[outcome] += 1
        self._mean_run_s = 0.8 * self._mean_run_s + 0.2 * seconds
        if self.active is run:
            self.active = None
        self.slot.release()

    def cancel_active(self) -> None:
        if self.active is not None:
            self.active.cancel()

    def shutdown(self, grace_s: float) -> None:
        """Take no more requests (queued ones fail now); cancel the running one if it takes over ``grace_s``."""
        if self.slot.closed:
            return
        self.slot.close()
        asyncio.get_running_loop().call_later(grace_s, self.cancel_active)

    def shutdown_threadsafe(self, grace_s: float) -> None:
        """`shutdown` from another thread or a signal handler (no-op before the server has started)."""
        if self.loop is not None:
            _post(self.loop, self.shutdown, grace_s)

    def health(self) -> dict:
        return {"busy": self.slot.busy, "shutting_down": self.slot.closed, "queued": self.slot.queued, "max_queue": self.max_queue,
                "completed": self.counts["completed"], "cancelled": self.counts["cancelled"],
                "failed": self.counts["failed"]}


def _post(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """Run ``callback(*args)`` on the event loop, from the worker thread (dropped once the loop has closed)."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass
