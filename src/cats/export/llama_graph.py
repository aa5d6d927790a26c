"""A Qwen2 GGUF rewritten as the same model in llama.cpp's Llama graph, so that llama.cpp's EAGLE-3 drafting runs it.

llama.cpp's EAGLE-3 drafting reads the target's layer inputs, which its ``qwen2`` graph does not record (build 11434
aborts with ``GGML_ASSERT(t_layer_inp[il] != nullptr)``; its ``llama`` graph records them). A Qwen2 decoder is a
Llama decoder with q/k/v biases and the half-split (NeoX) rotary, and llama.cpp's Llama graph loads optional q/k/v
biases and applies the interleaved rotary. So the same model runs there when

- the metadata's ``qwen2.*`` keys become ``llama.*`` and ``general.architecture`` becomes ``llama``;
- the rows of ``attn_q`` / ``attn_k`` (weights, whose quantised blocks run along rows, and biases) are reordered per
  head from the half-split to the interleaved order, as llama.cpp's converter does for Llama checkpoints.

Every other tensor's blocks and the tokenizer are copied unchanged: the same model up to rounding (llama.cpp's greedy
answers from the copy and the original part only at near-ties, ``docs/serving-at-scale.md``). The copy is for llama.cpp only: CATS reads the original file.
`gguf`'s writer does the file format; only the row order is ours.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import torch

from cats.cache_files import staging_path
from cats.errors import InvalidArgumentError
from cats.export.gguf_file import interleave_rotary

REWRITTEN = ("qwen2",)  # architectures whose llama.cpp graph lacks EAGLE-3's layer inputs and that this rewrites


def gguf_architecture(path: str | Path) -> str:
    """``general.architecture`` of a GGUF file."""
    field = gguf.GGUFReader(path).get_field(gguf.Keys.General.ARCHITECTURE)
    return str(field.contents()) if field is not None else ""


def write_llama_graph(source: str | Path, target: str | Path) -> Path:
    """Write the Qwen2 GGUF ``source`` as a Llama-graph GGUF at ``target`` (through a staging file, renamed into
    place when complete)."""
    reader = gguf.GGUFReader(source)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    if arch not in REWRITTEN:
        raise InvalidArgumentError(f"{Path(source).name} is a {arch!r} model; only {', '.join(REWRITTEN)} GGUF files "
                                   "are rewritten for llama.cpp's Llama graph (others run there as they are)")
    heads = int(reader.get_field(f"{arch}.attention.head_count").contents())
    kv_heads = int(reader.get_field(f"{arch}.attention.head_count_kv").contents())
    target = Path(target)
    staging = staging_path(target).with_suffix(".gguf")
    try:
        writer = gguf.GGUFWriter(staging, arch="llama", endianess=reader.endianess)
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue
            name = "llama." + field.name.removeprefix(f"{arch}.") if field.name.startswith(f"{arch}.") else field.name
            kind = field.types[0]
            writer.add_key_value(name, field.contents(), kind,
                                 sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
        for tensor in reader.tensors:
            writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                                   tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor in reader.tensors:
            data = tensor.data
            rotated = {"attn_q": heads, "attn_k": kv_heads}.get(tensor.name.split(".")[-2])
            if rotated is not None:  # rows of blocks (or of a bias) move whole
                data = interleave_rotary(torch.from_numpy(np.array(data)), rotated).numpy()
            writer.write_tensor_data(np.ascontiguousarray(data), tensor_endianess=reader.endianess)
        writer.close()
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
    return target
