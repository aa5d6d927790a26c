"""Checks of the files a model or an adapter is read from. A damaged file is a `DamagedFileError` that names the
file, what is wrong with it ("truncated at byte N of M", "not a GGUF file (starts with ...)", "missing tensor X")
and the fix, instead of whatever a parser deep below happens to raise.

The checks read headers only (a few KB; a GGUF's metadata): `check_gguf` walks the GGUF header (tensor types'
sizes from gguf-py) and compares where the tensor data ends with the file's size; `check_safetensors` reads the 8-byte header length and
the JSON header, compares the data's extent with the file's size and leaves the rest (dtypes, shapes against
offsets, gaps, overlaps) to the ``safetensors`` package's own validation. `check_loading_info` turns transformers'
report of missing, unexpected and mismatched tensors into the same kind of error.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import mmap
import struct
from pathlib import Path

from safetensors import SafetensorError, safe_open

from cats.errors import DamagedFileError, MissingDependencyError

REDOWNLOAD = "re-download it"
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def file_size(path: Path, fix: str) -> int:
    try:
        return path.stat().st_size
    except OSError as error:
        raise DamagedFileError(path, f"cannot be read ({error.strerror or error})", fix) from None


def file_start(path: Path, count: int, fix: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read(count)
    except OSError as error:
        raise DamagedFileError(path, f"cannot be read ({error.strerror or error})", fix) from None


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# ---------------------------------------------------------------------------------------------------------- GGUF
GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
GGUF_STRING, GGUF_ARRAY = 8, 9


def check_gguf(path: str | Path, fix: str = REDOWNLOAD) -> None:
    """Refuse a ``.gguf`` file that is empty, does not start with the magic ``GGUF``, has a header that does not
    parse, tensors that overlap or are misaligned, or that ends before its tensor data does. Reads the header only
    (a walk over its fields: ~50 ms for a 49k-token vocabulary, where gguf-py's full parse takes seconds)."""
    path = Path(path)
    size = file_size(path, fix)
    if size == 0:
        raise DamagedFileError(path, "is empty (0 bytes)", fix)
    start = file_start(path, 8, fix)
    if not start.startswith(b"GGUF"):
        raise DamagedFileError(path, f"is not a GGUF file (starts with {start!r}, not b'GGUF')", fix)
    if importlib.util.find_spec("gguf") is None:
        raise MissingDependencyError(f"reading {path.name} needs the 'gguf' package: pip install gguf")
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            tensors = gguf_tensors(data)
    except (struct.error, ValueError, KeyError, OverflowError) as error:
        raise DamagedFileError(path, f"has a damaged or truncated header ({size} bytes; {first_line(error)})",
                               fix) from None
    except OSError as error:
        raise DamagedFileError(path, f"cannot be read ({error.strerror or error})", fix) from None
    end = 0
    for name, begin, nbytes in sorted(tensors, key=lambda t: t[1]):
        if begin < end:
            raise DamagedFileError(path, f"has a damaged header (tensor {name!r} overlaps the one before it)", fix)
        end = begin + nbytes
    if end > size:
        raise DamagedFileError(path, f"is truncated at byte {size} of {end}", fix)


def gguf_tensors(data) -> list[tuple[str, int, int]]:
    """``(name, first byte, bytes)`` of every tensor of a GGUF file (versions 2 and 3, little-endian), from its
    header; ValueError or struct.error when the header is damaged."""
    constants = importlib.import_module("gguf.constants")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}; CATS reads versions 2 and 3")
    if tensor_count > len(data) or kv_count > len(data):
        raise ValueError(f"it claims {tensor_count} tensors and {kv_count} metadata fields")
    offset, alignment = 24, 32

    def string(at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", data, at)
        if at + 8 + length > len(data):
            raise ValueError(f"a string at byte {at} runs past the end of the file")
        return bytes(data[at + 8:at + 8 + length]).decode("utf-8"), at + 8 + length

    def skip(kind: int, at: int) -> int:
        if kind in GGUF_SCALARS:
            return at + GGUF_SCALARS[kind]
        if kind == GGUF_STRING:
            return string(at)[1]
        if kind != GGUF_ARRAY:
            raise ValueError(f"unknown metadata type {kind} at byte {at}")
        item, count = struct.unpack_from("<IQ", data, at)
        at += 12
        if item in GGUF_SCALARS:
            return at + count * GGUF_SCALARS[item]
        for _ in range(count):
            at = skip(item, at)
            if at > len(data):
                break
        return at

    for _ in range(kv_count):
        key, offset = string(offset)
        (kind,) = struct.unpack_from("<I", data, offset)
        if key == "general.alignment" and kind == 4:
            (alignment,) = struct.unpack_from("<I", data, offset + 4)
            if alignment == 0 or alignment & (alignment - 1):
                raise ValueError(f"general.alignment {alignment} is not a power of two")
        offset = skip(kind, offset + 4)
    infos = []
    for _ in range(tensor_count):
        name, offset = string(offset)
        (dims,) = struct.unpack_from("<I", data, offset)
        if dims > 8:
            raise ValueError(f"tensor {name!r} has {dims} dimensions")
        shape = struct.unpack_from(f"<{dims}Q", data, offset + 4)
        kind, begin = struct.unpack_from("<IQ", data, offset + 4 + 8 * dims)
        offset += 4 + 8 * dims + 12
        if begin % alignment:
            raise ValueError(f"tensor {name!r} starts at {begin}, not a multiple of the alignment {alignment}")
        block, type_size = constants.GGML_QUANT_SIZES[constants.GGMLQuantizationType(kind)]
        infos.append((name, begin, math.prod(shape) * type_size // block))
    data_start = -(-offset // alignment) * alignment
    return [(name, data_start + begin, nbytes) for name, begin, nbytes in infos]


# --------------------------------------------------------------------------------------------------- safetensors
def check_safetensors(path: str | Path, fix: str = REDOWNLOAD) -> None:
    """Refuse a ``.safetensors`` file that is shorter than its header or its data, has a header that is not
    JSON, or that the ``safetensors`` package refuses (bad dtype, shape against offsets, gaps)."""
    path = Path(path)
    size = file_size(path, fix)
    if size == 0:
        raise DamagedFileError(path, "is empty (0 bytes)", fix)
    if size < 8:
        raise DamagedFileError(path, f"is truncated at byte {size} of at least 8 (its header length)", fix)
    (length,) = struct.unpack("<Q", file_start(path, 8, fix))
    if 8 + length > size:
        raise DamagedFileError(path, f"is truncated at byte {size} of {8 + length} or more (inside its "
                                     f"{length}-byte header), or is not a safetensors file", fix)
    try:
        header = json.loads(file_start(path, 8 + length, fix)[8:])
        ends = [int(info["data_offsets"][1]) for name, info in header.items() if name != "__metadata__"]
    except (ValueError, UnicodeDecodeError, TypeError, KeyError, IndexError, AttributeError) as error:
        raise DamagedFileError(path, f"has a damaged header (not a safetensors JSON header: {first_line(error)})",
                               fix) from None
    end = 8 + length + max(ends, default=0)
    if end > size:
        raise DamagedFileError(path, f"is truncated at byte {size} of {end}", fix)
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except SafetensorError as error:  # the package's validation of the header against the data
        raise DamagedFileError(path, f"is damaged ({first_line(error)})", fix) from None


# ------------------------------------------------------------------------------------------------- model folders
def check_model_folder(folder: str | Path, fix: str = "re-download the model") -> None:
    """A model folder with a ``config.json`` holds weights (``*.safetensors`` or ``*.bin``), each safetensors file
    intact."""
    folder = Path(folder)
    weights = sorted({p for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern) if p.is_file()})
    if not weights:
        raise DamagedFileError(folder, "has a config.json but no weights (no *.safetensors or *.bin file)",
                               f"copy the model's weight files into it or {fix}")
    for path in weights:
        if path.suffix == ".safetensors":
            check_safetensors(path, fix)


def check_loading_info(info: dict, folder: str | Path, fix: str = "re-download the model") -> None:
    """transformers' loading report (``output_loading_info=True``): a tensor the model needs and the files lack,
    one the files hold and the model does not know, or one of another shape is a damaged checkpoint (transformers
    would otherwise start the missing ones from random values)."""
    missing, unexpected = sorted(info.get("missing_keys") or []), sorted(info.get("unexpected_keys") or [])
    mismatched = list(info.get("mismatched_keys") or [])
    if missing:
        raise DamagedFileError(folder, f"lacks tensor {missing[0]}" + _more(missing) + " that its config.json needs",
                               fix)
    if mismatched:
        name, *shapes = mismatched[0]
        raise DamagedFileError(folder, f"holds tensor {name} of the wrong shape ({' vs '.join(map(str, shapes))})"
                               + _more(mismatched), fix)
    if unexpected:
        raise DamagedFileError(folder, f"holds tensor {unexpected[0]}" + _more(unexpected) + " that its config.json "
                               "does not describe (config.json and the weights do not belong together)", fix)


def _more(items: list) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""
