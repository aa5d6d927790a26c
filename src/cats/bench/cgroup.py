"""A Linux memory cgroup around one benchmarked process, so that every method of a ``cats bench --memory-limit`` run
is held to the same limit by the kernel and measured the way the kernel charges it: anonymous memory *and* the page
cache the process touches (a memory-mapped model file included). No swap is allowed, so a process that needs more
is reclaimed (clean file pages are dropped and read again: the thrashing a too-small machine shows) or killed by the
kernel's OOM killer.

Both hierarchies are supported, whichever is mounted with a writable memory controller:

* v2 (``/sys/fs/cgroup`` with ``memory`` in ``cgroup.controllers``): ``memory.max``, ``memory.swap.max`` = 0,
  ``memory.peak``, ``memory.events`` (``oom_kill``), ``memory.stat`` (``pgmajfault``);
* v1 (``/sys/fs/cgroup/memory``): ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where swap
  accounting exists), ``memory.max_usage_in_bytes``, ``memory.failcnt``, ``memory.oom_control`` (``oom_kill``),
  ``memory.stat`` (``total_pgmajfault``).

A process joins the group from its first instruction (`MemoryCgroup.enter`, run as ``preexec_fn``), so its loading
is charged too. The cgroup is the kernel's tool; which layers stay resident and which stream stays CATS's planner's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from cats.errors import CatsError

V2_ROOT = Path("/sys/fs/cgroup")
V1_ROOT = Path("/sys/fs/cgroup/memory")
MIB = 1 << 20
PR_SET_PDEATHSIG = 1
_LIBC_NAME = ctypes.util.find_library("c")
_LIBC = ctypes.CDLL(_LIBC_NAME, use_errno=True) if _LIBC_NAME else None


class CgroupUnavailableError(CatsError):
    """No writable memory cgroup: the message says what was looked for and how to get one."""


@dataclass
class CgroupUsage:
    """What the kernel counted for the group's processes."""

    limit_bytes: int
    peak_bytes: int  # the group's own high-water mark: anonymous memory and page cache
    major_faults: int  # pages read from storage on access (a mapped file's pages, evicted and touched again)
    oom_kills: int  # processes the OOM killer ended in the group
    limit_hits: int | None  # v1: times the charge reached the limit (reclaim); None on v2

    def to_dict(self) -> dict:
        return {"memory_limit_mb": round(self.limit_bytes / MIB, 1), "peak_memory_mb": round(self.peak_bytes / MIB, 1),
                "major_faults": self.major_faults, "oom_kills": self.oom_kills, "limit_hits": self.limit_hits}


def _writable(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK)


def find_hierarchy() -> tuple[str, Path]:
    """``("v2", root)`` or ``("v1", root)`` for the first writable memory hierarchy; raises
    `CgroupUnavailableError` with what to do otherwise."""
    controllers = V2_ROOT / "cgroup.controllers"
    if controllers.is_file() and "memory" in controllers.read_text().split() and _writable(V2_ROOT):
        return "v2", V2_ROOT
    if (V1_ROOT / "memory.limit_in_bytes").is_file() and _writable(V1_ROOT):
        return "v1", V1_ROOT
    raise CgroupUnavailableError(
        "--memory-limit needs a writable Linux memory cgroup (v2: /sys/fs/cgroup with the memory controller; v1: "
        "/sys/fs/cgroup/memory); none is mounted writable here. Run as root, or in a container with its cgroup "
        "delegated (e.g. systemd-run --user --scope -p Delegate=yes), or use --memory-budget (CATS's own planner "
        "only, not enforced by the kernel)")


class MemoryCgroup:
    """One child group with a hard memory limit and no swap. Use as a context manager: the group is removed at the
    end (its processes must have exited)."""

    def __init__(self, name: str, limit_bytes: int):
        self.version, root = find_hierarchy()
        self.limit_bytes = int(limit_bytes)
        self.path = root / f"cats-{os.getpid()}-{name}"
        try:
            self.path.mkdir()
        except FileExistsError:
            self._remove()
            self.path.mkdir()
        except OSError as error:
            raise CgroupUnavailableError(f"cannot create the memory cgroup {self.path}: {error.strerror}") from None
        if self.version == "v2":
            self._write("memory.max", self.limit_bytes)
            if (self.path / "memory.swap.max").exists():
                self._write("memory.swap.max", 0)
        else:
            self._write("memory.limit_in_bytes", self.limit_bytes)
            if (self.path / "memory.memsw.limit_in_bytes").exists():
                self._write("memory.memsw.limit_in_bytes", self.limit_bytes)
            self._write("memory.swappiness", 0)

    def _write(self, name: str, value) -> None:
        (self.path / name).write_text(str(value))

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def enter(self) -> None:
        """Move the calling process into the group (as a ``preexec_fn``: the child joins before it runs anything),
        and have the kernel end it if the benchmark that started it dies (``PR_SET_PDEATHSIG``): an orphan left
        mapping the model would keep its pages cached for every later run."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))
        if _LIBC is not None:
            _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    def usage(self) -> CgroupUsage:
        stat = dict(line.split() for line in self._read("memory.stat").splitlines() if line.strip())
        if self.version == "v2":
            peak = int(self._read("memory.peak")) if (self.path / "memory.peak").exists() else int(
                self._read("memory.current"))
            events = dict(line.split() for line in self._read("memory.events").splitlines() if line.strip())
            return CgroupUsage(self.limit_bytes, peak, int(stat.get("pgmajfault", 0)), int(events.get("oom_kill", 0)),
                               None)
        control = dict(line.split() for line in self._read("memory.oom_control").splitlines() if line.strip())
        return CgroupUsage(self.limit_bytes, int(self._read("memory.max_usage_in_bytes")),
                           int(stat.get("total_pgmajfault", stat.get("pgmajfault", 0))),
                           int(control.get("oom_kill", 0)), int(self._read("memory.failcnt")))

    def _remove(self) -> None:
        for _ in range(50):  # a process that just exited may take a moment to leave the group
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)

    def __enter__(self) -> "MemoryCgroup":
        return self

    def __exit__(self, *exc) -> None:
        self._remove()
