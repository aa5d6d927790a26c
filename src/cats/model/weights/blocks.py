"""Block-quantised layer weights: a GGUF model's decoder weights streamed in their own blocks, decoded on load.

A model loaded from a GGUF file runs in float32 or bfloat16, but its weights are what the file's quantised blocks
decode to: a Q4_1 weight is 20 bytes per 32 values, 6.4x fewer than float32. The layer store keeps a streamed
layer's weights in those blocks when decoding them gives the model's own weights bit for bit (checked when the store
is made, `cats.model.weights.store`), and the layer reader decodes each layer into its buffer right after reading it
(``blocks.c``, called from the reader thread). A memory budget then reads 3-6x fewer bytes per pass for the same
weights and the same outputs.

Kinds: ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``, ``q8_0`` (32 values a block) and the k-quants ``q4_k``, ``q5_k``,
``q6_k`` (256). Values are computed as gguf-py computes them (float32, no fused multiply-add), then rounded to
bfloat16 (nearest even) for a bfloat16 model. The
decoder is built with the system C compiler on first use (`cats.model.kernels.native`); without one, `unavailable` says
why and stores keep plain weights.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import threading
from pathlib import Path

import torch

from cats.cache_files import Damaged, clean_stale, read_json, write_json
from cats.model.kernels.native import build_library
from cats.model.weights.budget import numel
from cats.model.weights.parts import pread_exact

SOURCE = Path(__file__).with_suffix(".c")
KINDS = {"q4_0": (0, 18, 32), "q4_1": (1, 20, 32), "q8_0": (2, 34, 32), "q5_0": (3, 22, 32), "q5_1": (4, 24, 32),
         "q4_k": (5, 144, 256), "q5_k": (6, 176, 256), "q6_k": (7, 210, 256)}  # kind: (code in blocks.c, bytes and
# values a block)
TARGETS = (torch.float32, torch.bfloat16)

_LOCK = threading.Lock()
_STATE: dict = {}


def _flags() -> tuple[str, ...]:
    native = ("-march=native",) if platform.machine() in ("x86_64", "AMD64") else ()
    return ("-O3", *native, "-ffp-contract=off", "-shared", "-fPIC")


def _library():
    if "reason" not in _STATE:
        with _LOCK:
            if "reason" not in _STATE:

                library, reason = build_library(SOURCE, _flags(), "blocks")
                if library is not None:
                    library.cats_decode_blocks.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long,
                                                           ctypes.c_void_p, ctypes.c_int]
                    library.cats_decode_blocks.restype = ctypes.c_int
                _STATE.update(library=library, reason=reason)
    return _STATE["library"], _STATE["reason"]


def unavailable() -> str | None:
    """None when the decoder runs here (building it on first call), else why not."""
    return _library()[1]


def gguf_kind(tensor_type) -> str | None:
    """The kind of a GGUF tensor type (``gguf.GGMLQuantizationType``), None for types this module does not decode."""
    name = getattr(tensor_type, "name", str(tensor_type)).lower()
    return name if name in KINDS else None


def coded_bytes(kind: str, values: int) -> int | None:
    """Bytes of ``values`` values in blocks of ``kind``; None when they are not whole blocks."""
    _, size, per_block = KINDS[kind]
    return None if values % per_block else values // per_block * size


def decode_into(kind: str, source: torch.Tensor, target: torch.Tensor) -> None:
    """Decode the blocks in ``source`` (contiguous uint8) into ``target`` (contiguous float32 or bfloat16, as many
    values as the blocks hold). Releases the GIL while it runs."""
    library, reason = _library()
    if library is None:
        raise RuntimeError(f"the block decoder is unavailable: {reason}")
    code, size, per_block = KINDS[kind]
    if source.dtype != torch.uint8 or not source.is_contiguous() or not target.is_contiguous():
        raise ValueError("decode_into needs contiguous uint8 blocks and a contiguous target")
    if target.dtype not in TARGETS:
        raise ValueError(f"blocks decode to float32 or bfloat16, not {target.dtype}")
    blocks = source.numel() // size
    if blocks * size != source.numel() or blocks * per_block != target.numel():
        raise ValueError(f"{source.numel()} bytes of {kind} blocks do not decode to {target.numel()} values")
    if library.cats_decode_blocks(code, source.data_ptr(), blocks, target.data_ptr(),
                                  int(target.dtype == torch.bfloat16)) != 0:
        raise RuntimeError(f"the block decoder refused kind {kind}")


def decode(kind: str, source: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    """The values of the blocks in ``source`` as a new tensor of ``shape`` and ``dtype``."""
    target = torch.empty(tuple(shape), dtype=dtype)
    decode_into(kind, source.contiguous().view(torch.uint8).reshape(-1), target)
    return target


class GGUFBlocks:
    """The decodable quantised tensors of a GGUF file, by decoder layer, read on demand with ``pread`` (the file is
    never mapped while the store is made, so memory stays at one tensor)."""

    def __init__(self, path: Path, layers: dict[int, list[tuple]] | None = None):
        self.path = Path(path)
        # layer -> [(tensor name, kind, rows, file offset, bytes)]
        self.layers: dict[int, list[tuple[str, str, int, int, int]]] = (
            self._index(self.path) if layers is None else {int(k): [tuple(t) for t in v] for k, v in layers.items()})

    @staticmethod
    def _index(path: Path) -> dict[int, list[tuple[str, str, int, int, int]]]:
        """The decodable tensors of the file's decoder layers (gguf-py's reader: seconds for a file with a large
        vocabulary in its metadata, hence `of_checkpoint` keeps the result)."""
        import gguf

        reader = gguf.GGUFReader(str(path))
        layers: dict[int, list[tuple[str, str, int, int, int]]] = {}
        for tensor in reader.tensors:
            kind, parts = gguf_kind(tensor.tensor_type), tensor.name.split(".")
            if kind is None or len(parts) < 3 or parts[0] != "blk" or not parts[1].isdigit():
                continue
            rows = int(tensor.data.shape[0])  # quantised data is [rows, bytes a row]
            layers.setdefault(int(parts[1]), []).append(
                (tensor.name, kind, rows, int(tensor.data_offset), int(tensor.n_bytes)))
        del reader  # unmaps the file
        return layers

    @classmethod
    def of_checkpoint(cls, folder: Path, dtype: torch.dtype) -> "GGUFBlocks | None":
        """The GGUF file a converted checkpoint folder came from (``cats-source.json``), when its blocks can serve
        a store in ``dtype`` here; else None."""
        import json

        record = Path(folder) / "cats-source.json"
        if dtype not in TARGETS or not record.is_file() or unavailable() is not None:
            return None
        try:
            path = Path(json.loads(record.read_text())["gguf"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not path.is_file():
            return None
        key = _file_record(path)
        index = Path(folder) / "cats-blocks.json"  # the file's tensor index, kept beside the checkpoint
        clean_stale(Path(folder), index.name)
        try:
            kept = read_json(index)
            if kept["file"] == key:
                return cls(path, kept["layers"])
        except (OSError, Damaged, KeyError, TypeError):
            pass  # none yet, or damaged: index the file again
        blocks = cls(path)
        with contextlib.suppress(OSError):  # a read-only checkpoint folder: index it again next time
            write_json(index, {"file": key, "layers": blocks.layers})
        return blocks

    def record(self) -> dict:
        """What keys a store made with these blocks (the file's name, size and modification time)."""
        return _file_record(self.path)

    def layer_bytes(self, layer: int, shapes: dict[str, tuple[int, ...]], itemsize: int) -> int:
        """What decoder layer ``layer`` occupies in a store when every candidate decodes exactly: a parameter with a
        decodable tensor of its shape in the file takes that tensor's bytes, every other its plain bytes (a tensor
        whose blocks turn out not to decode to the checkpoint's bits is stored plain, larger: the load then plans
        again)."""
        total, free = 0, list(self.layers.get(layer, []))
        for shape in shapes.values():
            count = numel(shape)
            match = next((t for t in free if _fits(t, shape)), None)
            if match is not None:
                free.remove(match)
            total += match[4] if match is not None else count * itemsize
        return total

    def encode(self, layer: int, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, torch.Tensor]]:
        """For each 2-D tensor of decoder layer ``layer`` (the checkpoint's, in the store's dtype) that one of the
        file's tensors of that layer decodes to bit for bit, rows possibly reordered: ``name -> (kind, blocks)``,
        the blocks ``[rows, bytes a row]`` in the tensor's row order."""

        found, taken = {}, set()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for name, weight in tensors.items():
                if weight.dim() != 2 or weight.dtype not in TARGETS:
                    continue
                for entry in self.layers.get(layer, []):
                    tensor_name, kind, rows, offset, size = entry
                    if tensor_name in taken or not _fits(entry, tuple(weight.shape)):
                        continue
                    raw = torch.empty(size, dtype=torch.uint8)
                    pread_exact(fd, memoryview(raw.numpy()), offset, size, self.path)
                    raw = raw.view(rows, size // rows)  # every row is whole blocks: rows decode on their own
                    order = _row_order(decode(kind, raw, weight.shape, weight.dtype), weight)
                    if order is None:
                        continue
                    found[name] = (kind, raw if order is _SAME_ORDER else raw[order].contiguous())
                    taken.add(tensor_name)
                    break
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return found


def _file_record(path: Path) -> dict:
    stat = path.stat()
    return {"gguf": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _fits(entry: tuple, shape: tuple[int, ...]) -> bool:
    """Whether the file's tensor ``entry`` (name, kind, rows, offset, bytes) holds as many rows and values as a
    tensor of ``shape``."""
    _, kind, rows, _, size = entry
    return len(shape) == 2 and rows == shape[0] and size == coded_bytes(kind, numel(shape))


_SAME_ORDER = object()  # `_row_order`: the rows are in the weight's order already


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view({4: torch.int32, 2: torch.int16}[tensor.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _row_order(decoded: torch.Tensor, weight: torch.Tensor):
    """Indices ``order`` with ``decoded[order]`` equal to ``weight`` bit for bit (`_SAME_ORDER` when that is the
    identity), or None."""
    if _same_bits(decoded, weight):
        return _SAME_ORDER
    where: dict[bytes, int] = {}
    for index, row in enumerate(_bits(decoded).numpy()):
        where.setdefault(row.tobytes(), index)
    order = [where.get(row.tobytes()) for row in _bits(weight).numpy()]
    return None if None in order else torch.tensor(order, dtype=torch.long)
