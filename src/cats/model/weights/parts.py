"""Safetensors files read and written without mapping them: the layer store's part files (written with the header
padded so that the tensor data starts at a multiple of 4096 bytes, see `cats.model.weights.store`), their headers,
``pread`` reads of a whole part's data or of one tensor's rows, and `Checkpoint`, the tensors of a safetensors
checkpoint folder. Errors are `StoreError`s."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from cats.errors import CatsError
from cats.model.weights.budget import numel, round_up

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


class StoreError(CatsError):
    """A layer store that is missing, damaged, made from another model, or cannot be written."""


# --------------------------------------------------------------------------------------------- part files
@dataclass(frozen=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the start of the data
    end: int


@dataclass(frozen=True)
class PartHeader:
    path: Path
    data_start: int  # file offset of the tensor data (a multiple of STORE_ALIGNMENT in files this module writes)
    data_bytes: int
    entries: dict[str, TensorEntry]

    @property
    def layout(self) -> tuple:
        """What two parts must share for one buffer layout to serve both (names, dtypes, shapes, offsets)."""
        return tuple((name, e.dtype, e.shape, e.begin, e.end) for name, e in sorted(self.entries.items()))

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """The part's tensors as views of ``buffer`` (uint8, holding the data section from offset 0)."""
        return {name: buffer[e.begin:e.end].view(e.dtype).view(e.shape) for name, e in self.entries.items()}


def data_layout(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> tuple[dict[str, TensorEntry], int]:
    """Where tensors ``{name: (dtype, shape)}`` lie in a part's data, and its bytes: ordered by element size
    (largest first, so every offset is aligned for its dtype), then by name, back to back."""
    entries, offset = {}, 0
    for name, (dtype, shape) in sorted(specs.items(), key=lambda item: (-item[1][0].itemsize, item[0])):
        size = dtype.itemsize * numel(shape)
        entries[name] = TensorEntry(dtype, shape, offset, offset + size)
        offset += size
    return entries, offset


def write_part(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Write ``tensors`` as a safetensors file whose data starts at a multiple of 4096; fsync it and drop it from the
    page cache. Tensors are ordered by element size (largest first) so every offset is aligned for its dtype.
    Returns the file size."""
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPE_NAMES:
            raise StoreError(f"cannot store tensor {name!r} of dtype {tensor.dtype}")
    entries, data_bytes = data_layout({name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items()})
    header = {name: {"dtype": DTYPE_NAMES[e.dtype], "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
              for name, e in entries.items()}
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (round_up(8 + len(raw)) - 8 - len(raw))
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
        for name in entries:  # in layout order
            handle.write(memoryview(tensors[name].detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()))
        handle.flush()
        os.fsync(handle.fileno())
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return 8 + len(raw) + data_bytes


def read_header(path: Path) -> PartHeader:
    """Parse a safetensors header; refuse a file shorter than its header says (truncated) or with gaps."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise StoreError(f"layer file {path} is truncated ({size} bytes, not even a header)")
            length = struct.unpack("<Q", prefix)[0]
            if length > size - 8:
                raise StoreError(f"layer file {path} is truncated: its header needs {length} bytes, the file has {size}")
            header = json.loads(handle.read(length))
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # the header's pages and read-ahead
    except OSError as error:
        raise StoreError(f"cannot read layer file {path}: {error.strerror or error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise StoreError(f"layer file {path} has a damaged header") from None
    header.pop("__metadata__", None)
    entries, end = {}, 0
    for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        begin, stop = info["data_offsets"]
        if info["dtype"] not in SAFETENSORS_DTYPES or begin != end:
            raise StoreError(f"layer file {path} is damaged (tensor {name!r})")
        entries[name] = TensorEntry(SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]), begin, stop)
        end = stop
    data_start = 8 + length
    if size < data_start + end:
        raise StoreError(f"layer file {path} is truncated: {size} bytes, its header promises {data_start + end}; "
                         "delete the store folder to rebuild it")
    return PartHeader(path, data_start, end, entries)


def pread_exact(fd: int, buffer: memoryview, offset: int, nbytes: int, path: Path) -> None:
    """Read ``nbytes`` at ``offset`` into ``buffer`` (which may be longer: O_DIRECT reads whole aligned blocks),
    looping over short reads; a read that ends early means the file was truncated."""
    done = 0
    while done < nbytes:
        try:
            count = os.preadv(fd, [buffer[done:]], offset + done)
        except OSError as error:
            raise StoreError(f"reading {path} failed: {error.strerror or error}") from None
        if count <= 0:
            raise StoreError(f"layer file {path} is truncated: read {done} of {nbytes} bytes; delete the store "
                             "folder to rebuild it")
        done += count


def read_data(header: PartHeader) -> torch.Tensor:
    """A part file's data section in one freshly allocated buffer (buffered read, then dropped from the page cache)."""
    buffer = torch.empty(header.data_bytes, dtype=torch.uint8)
    fd = os.open(header.path, os.O_RDONLY)
    try:
        pread_exact(fd, memoryview(buffer.numpy()), header.data_start, header.data_bytes, header.path)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return buffer


def read_part(header: PartHeader) -> dict[str, torch.Tensor]:
    """A plain part's tensors in one freshly allocated buffer (`LayerStore.read` decodes quantised ones)."""
    return header.views(read_data(header))


class Checkpoint:
    """The tensors of a safetensors checkpoint folder (one file or an index of shards), read without mapping it."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise StoreError(f"{folder} holds no .safetensors files to build a layer store from")
        self.headers = [read_header(path) for path in files]
        self.where = {name: header for header in self.headers for name in header.entries}

    def source(self) -> dict:
        """Path, names, sizes and modification times of the checkpoint files; their digest keys the store."""
        files = [{"name": h.path.name, "size": h.path.stat().st_size, "mtime_ns": h.path.stat().st_mtime_ns}
                 for h in self.headers]
        digest = hashlib.sha256(json.dumps([str(self.folder.resolve()), files]).encode()).hexdigest()
        return {"kind": "checkpoint", "folder": str(self.folder.resolve()), "files": files, "digest": digest}

    def find(self, name: str, aliases: dict[str, str]) -> tuple[PartHeader, TensorEntry]:
        for candidate in (name, aliases.get(name)):
            if candidate is not None and candidate in self.where:
                header = self.where[candidate]
                return header, header.entries[candidate]
        raise StoreError(f"checkpoint {self.folder} has no tensor {name!r}; a layer store can be built from "
                         "checkpoints whose tensor names are the model's parameter names")

    def read(self, name: str, aliases: dict[str, str], rows: slice | None = None) -> torch.Tensor:
        header, _ = self.find(name, aliases)
        return read_tensor(header, name if name in header.entries else aliases[name], rows)


def read_tensor(header: PartHeader, name: str, rows: slice | None = None) -> torch.Tensor:
    """One tensor of a safetensors file (or a strided selection of its rows), read with ``pread`` into fresh
    memory (no mapping) and dropped from the page cache."""
    entry = header.entries[name]
    row_numel = 1
    for dim in entry.shape[1:]:
        row_numel *= dim
    row_bytes = row_numel * entry.dtype.itemsize
    fd = os.open(header.path, os.O_RDONLY)
    try:
        if rows is None:
            out = torch.empty(entry.end - entry.begin, dtype=torch.uint8)
            pread_exact(fd, memoryview(out.numpy()), header.data_start + entry.begin, out.numel(), header.path)
            tensor = out.view(entry.dtype).view(entry.shape)
        else:
            indices = range(entry.shape[0])[rows]
            out = torch.empty(len(indices), row_bytes, dtype=torch.uint8)
            for i, row in enumerate(indices):
                pread_exact(fd, memoryview(out[i].numpy()), header.data_start + entry.begin + row * row_bytes,
                            row_bytes, header.path)
            tensor = out.view(entry.dtype).view(len(indices), *entry.shape[1:])
        os.posix_fadvise(fd, header.data_start + entry.begin, entry.end - entry.begin, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return tensor


__all__ = ["DTYPE_NAMES", "SAFETENSORS_DTYPES", "Checkpoint", "PartHeader", "StoreError", "TensorEntry", "data_layout",
           "pread_exact", "read_data", "read_header", "read_part", "read_tensor", "write_part"]
