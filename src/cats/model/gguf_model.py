"""A GGUF model on its own blocks: the model of the file's config (CATS's own Llama-family decoder,
`cats.model.decoder`, where it builds it: Llama, Mistral, Qwen2; transformers' class otherwise), with every linear
and the embedding replaced by modules that hold the file's rows as stored (memory-mapped,
`cats.model.kernels.gguf_modules`) and compute
on them with `cats.model.kernels.quantized`. No float copy of a weight is made, on disk or in memory: the resident
weight bytes are the file's tensor bytes. Float32 tensors that transformers uses as stored (norms, biases) are views
of the file too; the few it changes (Gemma's norms) are float32 copies. For Llama-family files, whose q and k rows
llama.cpp's converter reordered, the rows stay in the file's order and those linears reorder their outputs.

Which GGUF tensor feeds which module is transformers' own mapping (``get_gguf_hf_weights_map``, built on gguf-py's
tensor names), and each tensor gets transformers' own processing for its architecture (its ``TENSOR_PROCESSORS``):
applied to the row order of quantised tensors and to the values of float ones.
"""
from __future__ import annotations

import json
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import AutoConfig
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

from cats.errors import DamagedFileError
from cats.model.decoder import skeleton
from cats.model.gguf_names import shared_name_maps
from cats.model.kernels import quantized
from cats.model.kernels.gguf_modules import GGUFEmbedding, GGUFLinear, file_rows
from cats.model.source import TENSOR_INDEX
from cats.model.weights.large_pages import madvise, release_pages



class Unsupported(Exception):
    """The file holds something the quantised kernels do not run (the message says what); load it dequantised."""


def tensor_index(metadata: Path) -> dict:
    return json.loads((metadata / TENSOR_INDEX).read_text())


def check_runnable(metadata: Path) -> None:
    """Raise `Unsupported` unless the kernels run here and take every 2-D tensor of the file."""
    reason = quantized.unavailable()
    if reason is not None:
        raise Unsupported(f"the quantised kernels cannot run here ({reason})")
    for name, entry in tensor_index(metadata)["tensors"].items():
        if len(entry["shape"]) == 2 and not quantized.supports(entry["type"], entry["shape"][1]):
            type_name = quantized.TYPE_NAMES.get(entry["type"], f"type {entry['type']}")
            raise Unsupported(f"{name} is {type_name} with rows of {entry['shape'][1]} values, which the quantised "
                              "kernels do not take")


@dataclass(frozen=True)
class FileMapping:
    """Where a GGUF model's file is memory-mapped (``hf_model.gguf_mapping``): a tensor viewing it lies at file
    offset ``tensor.data_ptr() - address``."""

    path: Path
    address: int
    size: int

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """The file offset of ``tensor``'s data, or None where it is not a view of the file (a copy)."""
        if tensor.is_meta:
            return None
        offset = tensor.data_ptr() - self.address
        return offset if 0 <= offset and offset + tensor.numel() * tensor.element_size() <= self.size else None

    def read_at_random(self, tensor: torch.Tensor) -> None:
        """Tell the kernel that ``tensor``'s pages are read at random (``MADV_RANDOM``): a fault reads its own page
        only, not the pages around it (an embedding table, of which each token reads one row)."""
        offset = self.offset_of(tensor)
        if offset is None:
            return
        page = mmap.PAGESIZE
        first = (self.address + offset) // page * page
        last = self.address + offset + tensor.numel() * tensor.element_size()
        madvise(first, last - first, mmap.MADV_RANDOM)

    def release(self, offset: int, length: int) -> None:
        """Hand the pages of bytes ``[offset, offset + length)`` back to the kernel: unmapped from this process
        (``MADV_DONTNEED``; read again from the file if touched) and dropped from the page cache where no one else
        maps them (``POSIX_FADV_DONTNEED``). Only whole pages inside the range are released."""
        release_pages(self.path, self.address, offset, length)


class _File:
    """The GGUF file memory-mapped once, its tensors as views."""

    def __init__(self, path: Path, index: dict):
        self.path, self.tensors = path, index["tensors"]
        self.map = np.memmap(path, dtype=np.uint8, mode="r")
        if self.map.shape[0] != index["file_bytes"]:
            raise DamagedFileError(path, f"is {self.map.shape[0]} bytes, its index says {index['file_bytes']}",
                                   "if it changed, run again (it is indexed anew); if it is damaged, re-download it")
        self.mapping = FileMapping(path, self.map.ctypes.data, self.map.shape[0])

    def rows(self, name: str) -> tuple[torch.Tensor, int, int]:
        """``(uint8 [rows, row bytes] view, type code, columns)`` of tensor ``name``."""
        entry = self.tensors[name]
        data = self.map[entry["offset"]: entry["offset"] + entry["bytes"]]
        shape = entry["shape"] if len(entry["shape"]) == 2 else [1, entry["shape"][0]]
        return file_rows(data.reshape(shape[0], -1)), entry["type"], shape[1]

    def floats(self, name: str) -> np.ndarray:
        """Tensor ``name`` as float32 values: a view of the file where it stores float32, else a copy."""
        blocks, type_code, columns = self.rows(name)
        if type_code == 0:
            return blocks.numpy().view(np.float32).reshape(self.tensors[name]["shape"])
        return GGUFLinear(blocks, type_code, columns).dequantized().numpy().reshape(self.tensors[name]["shape"])

    def processed_floats(self, processor: TensorProcessor, name: str) -> torch.Tensor:
        """Tensor ``name`` as float32 after transformers' processing: a view of the file where that leaves the
        stored float32 values as they are."""
        values = self.floats(name)
        processed = processor.process(values, name).weights
        if processed is values or (processed.dtype == np.float32 and processed.shape == values.shape
                                   and np.array_equal(processed, values)):
            return file_rows(values)
        return torch.from_numpy(np.ascontiguousarray(processed, dtype=np.float32))


def _row_order(processor: TensorProcessor, gguf_name: str, rows: int) -> np.ndarray | None:
    """The permutation transformers' processor applies to the rows of ``gguf_name`` (None: none)."""
    order = processor.process(np.arange(rows).reshape(rows, 1), gguf_name).weights.reshape(-1)
    return None if np.array_equal(order, np.arange(rows)) else order


def _embedding_scale(module: nn.Embedding) -> float | None:
    """The factor a scaled embedding (Gemma3's) multiplies its rows by, else None."""
    scale = getattr(module, "embed_scale", None)
    return None if scale is None else float(scale)


def load_gguf_model(gguf_path: Path, metadata: Path, attn_implementation: str = "sdpa"):
    """The ``*ForCausalLM`` module (`cats.model.decoder.skeleton`) for the GGUF file ``gguf_path`` (its metadata
    folder ``metadata``, from `cats.model.source.gguf_metadata`), computing on the file's blocks; check
    `check_runnable` first."""
    config = AutoConfig.from_pretrained(metadata)
    index = tensor_index(metadata)
    file = _File(gguf_path, index)
    hf_model = skeleton(config, attn_implementation)
    processor = TENSOR_PROCESSORS.get(index["architecture"], TensorProcessor)(config=config.to_dict())
    with shared_name_maps():
        to_gguf = {hf: gguf for gguf, hf in get_gguf_hf_weights_map(hf_model, processor).items()}
    missing = []

    def source(hf_name: str) -> str | None:
        name = to_gguf.get(hf_name)
        if name is None or name not in file.tensors:
            return None
        return name

    for module_name, module in list(hf_model.named_modules()):
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            name = source(prefix + "weight")
            if name is None and module is hf_model.lm_head:  # a tied head: the embedding's rows
                name = source("model.embed_tokens.weight")
            if name is None:
                missing.append(prefix + "weight")
                continue
            blocks, type_code, columns = file.rows(name)
            order = _row_order(processor, name, blocks.shape[0])
            if isinstance(module, nn.Embedding):
                if order is not None:
                    blocks = blocks[torch.from_numpy(order)]  # (no architecture reorders its embedding rows)
                replacement = GGUFEmbedding(blocks, type_code, columns, _embedding_scale(module))
            else:
                bias_name = source(prefix + "bias") if module.bias is not None else None
                bias = None
                if bias_name is not None:
                    bias = file.processed_floats(processor, bias_name)
                elif module.bias is not None:
                    missing.append(prefix + "bias")
                replacement = GGUFLinear(blocks, type_code, columns, bias,
                                         None if order is None else torch.from_numpy(order))
            hf_model.set_submodule(module_name, replacement)
            continue
        for parameter_name, parameter in list(module._parameters.items()):
            if parameter is None or not parameter.is_meta:
                continue
            name = source(prefix + parameter_name)
            if name is None:
                missing.append(prefix + parameter_name)
                continue
            module._parameters[parameter_name] = nn.Parameter(file.processed_floats(processor, name),
                                                              requires_grad=False)
    if missing:
        raise DamagedFileError(gguf_path, f"has no tensor for {', '.join(missing[:4])}"
                                          f"{' ...' if len(missing) > 4 else ''}",
                               "use a complete GGUF file, or load it with --kernels aten to see transformers' view")
    hf_model.gguf_mapping = file.mapping
    return hf_model.eval()
