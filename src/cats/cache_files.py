"""Files CATS keeps in its cache, written and checked so that a cached file is never silently wrong.

* **Staging**: a file or folder is written under a staging name beside its target,
  ``.<target>.tmp-<pid>-<random>``, ``fsync``ed, renamed into place, and the folder holding it ``fsync``ed: a
  target is whole or absent, never half-written.
* **Stale staging**: `clean_stale` removes the staging entries of processes that are gone (a killed run);
  a live process's are kept (``os.kill(pid, 0)``).
* **Records**: `describe` records a file's size, ``mtime_ns`` and CRC-32. `check_files` trusts a file whose size
  and ``mtime_ns`` match its record (no read) and otherwise recomputes its CRC-32: the same content refreshes the
  record, another one is `Damaged`. A CRC-32 of SmolLM2-135M's 538 MB converted checkpoint takes ~0.15-0.25 s on
  a 2-core CPU; the size and ``mtime_ns`` check keeps that off every load of a model of many gigabytes.
* **Checked JSON**: `write_json` stores a CRC-32 of the content inside the file; `read_json` checks it.

Whoever finds a `Damaged` file removes it (`discard`), prints a one-line `notice` and makes it again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

BLOCK = 1 << 22  # 4 MiB reads for checksums
STAGING = re.compile(r"^\.(?P<target>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}$")
LEGACY_AGE_S = 24 * 3600  # staging entries of older CATS versions (no pid in the name) are removed after a day
_MINE: set[str] = set()  # staging names this process made (a killed run in a container may have had our pid)


class Damaged(Exception):
    """A cached file or folder that does not match its record (missing, truncated, other bytes)."""


def notice(message: str) -> None:
    """One line on stderr, the way CATS reports what it does to its cache."""
    print(f"cats: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------- staging
def staging_path(target: Path) -> Path:
    """A fresh staging name beside ``target`` naming this process: ``.<target>.tmp-<pid>-<random>``."""
    target = Path(target)
    name = f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    _MINE.add(name)
    return target.with_name(name)


def _alive(pid: int, name: str) -> bool:
    """Whether the process that made staging entry ``name`` may still be writing it."""
    if pid == os.getpid():
        return name in _MINE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OverflowError:  # not a pid this system can have
        return False
    except OSError:  # EPERM: it exists and belongs to someone else
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def clean_stale(folder: Path, target: str | None = None, legacy: re.Pattern | None = None) -> None:
    """Remove the staging entries in ``folder`` (only those of ``target`` when given) whose process is gone, and
    entries matching ``legacy`` (older CATS versions' staging names) untouched for a day."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        match = STAGING.match(entry.name)
        if match is not None:
            if (target is None or match["target"] == target) and not _alive(int(match["pid"]), entry.name):
                _remove(Path(entry.path))
        elif legacy is not None and legacy.fullmatch(entry.name):
            with contextlib.suppress(OSError):
                if time.time() - entry.stat(follow_symlinks=False).st_mtime > LEGACY_AGE_S:
                    _remove(Path(entry.path))


def fsync_path(path: Path) -> None:
    """``fsync`` a file or a folder (a folder: so that a rename in it survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(staging: Path, target: Path) -> None:
    """Move a finished staging file over ``target`` (atomic) and ``fsync`` it and its folder."""
    fsync_path(staging)
    os.replace(staging, target)
    fsync_path(Path(target).parent)


def write_bytes(target: Path, data: bytes) -> None:
    """Write ``target`` atomically: a staging file, ``fsync``, rename, ``fsync`` of the folder."""
    target = Path(target)
    staging = staging_path(target)
    try:
        with open(staging, "xb") as handle:
            handle.write(data)
        commit(staging, target)
    except BaseException:
        with contextlib.suppress(OSError):
            staging.unlink()
        raise


@contextlib.contextmanager
def staging_folder(target: Path) -> Iterator[Path]:
    """A fresh staging folder beside ``target`` to write into; when the block ends normally its files and the
    folder are ``fsync``ed and it is renamed to ``target`` (when another process made ``target`` first, that one is
    kept and the staging folder removed); when it raises, the staging folder is removed."""
    target = Path(target)
    staging = staging_path(target)
    staging.mkdir()
    try:
        yield staging
        for path in staging.rglob("*"):
            if path.is_file():
                fsync_path(path)
        fsync_path(staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished the same target first
            shutil.rmtree(staging, ignore_errors=True)
        fsync_path(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def discard(target: Path) -> None:
    """Remove a damaged file or folder: renamed to a staging name first, so that a run killed while removing it
    leaves an entry `clean_stale` removes, never a half-removed target."""
    target = Path(target)
    doomed = staging_path(target)
    try:
        os.rename(target, doomed)
    except FileNotFoundError:
        return
    except OSError:
        doomed = target
    _remove(doomed)


# --------------------------------------------------------------------------------------------- records
def file_key(path: Path) -> str:
    """16 hex digits naming a file as it is now (its resolved path, size and modification time), for what is
    derived from it and cached: a changed or moved file gets a new key, and nothing of it is read."""
    resolved = Path(path).resolve()
    status = resolved.stat()
    return hashlib.sha256(f"{resolved}\0{status.st_size}\0{status.st_mtime_ns}".encode()).hexdigest()[:16]


def checksum(path: Path) -> str:
    """CRC-32 of a file's bytes, read in 4 MiB blocks, as 8 hex digits; the blocks read are dropped from the page
    cache (a check must not fill memory with a file that is streamed to keep memory free)."""
    value, offset, buffer = 0, 0, bytearray(BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            value = zlib.crc32(view[:count], value)
            os.posix_fadvise(handle.fileno(), offset, count, os.POSIX_FADV_DONTNEED)
            offset += count
    return f"{value:08x}"


def describe(path: Path) -> dict:
    """What `check_files` checks a file against: its size, ``mtime_ns`` and CRC-32."""
    status = os.stat(path)
    record = {"size": status.st_size, "mtime_ns": status.st_mtime_ns, "crc32": checksum(path)}
    if os.stat(path).st_mtime_ns != status.st_mtime_ns:
        raise Damaged(f"{path} changed while its checksum was computed")
    return record


def describe_files(folder: Path, names) -> dict[str, dict]:
    return {name: describe(Path(folder) / name) for name in sorted(names)}


def check_files(folder: Path, records: dict[str, dict]) -> bool:
    """Check the files ``{name: record}`` in ``folder`` against their records (`describe`): a file whose size and
    ``mtime_ns`` match is trusted, any other is read and its CRC-32 compared. Raises `Damaged` (naming the file
    and what is wrong) on the first mismatch; returns True when a file had another ``mtime_ns`` but its recorded
    content, in which case its record was updated in place (the caller may save the records)."""
    refreshed = False
    for name, record in records.items():
        path = Path(folder) / name
        try:
            status = os.stat(path)
        except FileNotFoundError:
            raise Damaged(f"{path} is missing") from None
        except OSError as error:
            raise Damaged(f"{path} cannot be read ({error.strerror or error})") from None
        if status.st_size != record.get("size"):
            raise Damaged(f"{path} has {status.st_size} bytes, not {record.get('size')} (truncated or damaged)")
        if status.st_mtime_ns == record.get("mtime_ns"):
            continue
        try:
            same = checksum(path) == record.get("crc32")
        except OSError as error:
            raise Damaged(f"{path} cannot be read ({error.strerror or error})") from None
        if not same:
            raise Damaged(f"{path} does not match its checksum")
        record["mtime_ns"], refreshed = status.st_mtime_ns, True
    return refreshed


def write_record(folder: Path, name: str, data: dict) -> None:
    """Write ``name`` in ``folder`` (`write_json`): ``data`` plus ``"files"``, the records of every other file in
    the folder (`describe`); `check_folder` checks the folder against it."""
    files = [str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file() and p.name != name]
    write_json(Path(folder) / name, {**data, "files": describe_files(folder, files)})


def check_folder(folder: Path, name: str) -> dict:
    """Check ``folder`` against its record ``name`` (`write_record`), saving refreshed modification times, and
    return the record. Raises FileNotFoundError when ``folder`` does not exist, `Damaged` when it does not match
    (files the record does not list are not checked)."""
    record = Path(folder) / name
    if not record.is_file():
        if Path(folder).exists():
            raise Damaged(f"{record} is missing (unfinished, or made by an older CATS)")
        raise FileNotFoundError(record)
    data = read_json(record)
    if not isinstance(data.get("files"), dict) or not data["files"]:
        raise Damaged(f"{record} lists no files")
    if check_files(folder, data["files"]):
        with contextlib.suppress(OSError):  # a read-only cache: checked again next time
            write_json(record, data)
    return data


# --------------------------------------------------------------------------------------------- checked JSON
def _content_checksum(data: dict) -> str:
    return f"{zlib.crc32(json.dumps(data, sort_keys=True, separators=(',', ':')).encode()):08x}"


def write_json(target: Path, data: dict) -> None:
    """Write ``data`` (a dict of JSON values) atomically, with a CRC-32 of its content under ``"crc32"``."""
    data = json.loads(json.dumps(data))  # as `read_json` will see it (tuples as lists, keys as strings)
    text = json.dumps({**data, "crc32": _content_checksum(data)}, indent=2) + "\n"
    write_bytes(target, text.encode())


def read_json(path: Path) -> dict:
    """A file `write_json` wrote, checked. Raises FileNotFoundError when it is absent and `Damaged` when it does not
    parse or does not match its checksum."""
    try:
        data = json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise
    except OSError as error:
        raise Damaged(f"{path} cannot be read ({error.strerror or error})") from None
    except ValueError:
        raise Damaged(f"{path} is not valid JSON (damaged)") from None
    if not isinstance(data, dict) or "crc32" not in data:
        raise Damaged(f"{path} has no checksum (written by an older CATS, or damaged)")
    recorded = data.pop("crc32")
    if recorded != _content_checksum(data):
        raise Damaged(f"{path} does not match its checksum")
    return data


__all__ = ["Damaged", "check_files", "check_folder", "checksum", "clean_stale", "commit", "describe", "describe_files",
           "discard", "fsync_path", "notice", "read_json", "staging_folder", "staging_path", "write_bytes", "write_json",
           "write_record"]
