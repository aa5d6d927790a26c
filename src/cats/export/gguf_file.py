"""The llama.cpp layout of an EAGLE-3 head: a GGUF of architecture ``eagle3`` (`cats.export.layout`), written with the
``gguf`` package. It carries the target GGUF's tokenizer, because llama-server refuses a draft whose vocabulary
differs from the target's; so the target must be a GGUF file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from cats.errors import InvalidArgumentError
from cats.export.hf_folder import DTYPES, head_tensors
from cats.export.layout import engine_aux_ids
from cats.model import LayeredModel
from cats.model.eagle3 import Eagle3Head
from cats.model.source import gguf_file

ARCH = "eagle3"
TYPES = {torch.bfloat16: GGMLQuantizationType.BF16, torch.float16: GGMLQuantizationType.F16,
         torch.float32: GGMLQuantizationType.F32}
# EAGLE-3 checkpoint name -> llama.cpp tensor name (llama.cpp's converter maps them the same way)
NAMES = {
    "fc.weight": "fc.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}


def interleave_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection from the half-split rotary layout (HF: pairs i, i + d/2 in each head) to the
    interleaved one (llama.cpp's NORM rope: pairs 2i, 2i + 1)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def target_gguf(model: LayeredModel) -> Path:
    path = gguf_file(model.name)
    if path is None:
        raise InvalidArgumentError(f"a llama.cpp export copies the target GGUF's tokenizer, but {model.name!r} is not "
                                   "a GGUF file: pass the GGUF the head was trained for with --model")
    return path


def write_gguf(head: Eagle3Head, model: LayeredModel, out: Path, dtype: str) -> Path:
    """Write ``out`` (a ``.gguf`` file; a folder gets ``eagle3-head.gguf`` inside)."""
    if out.suffix.lower() != ".gguf":
        out.mkdir(parents=True, exist_ok=True)
        out = out / "eagle3-head.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    source = GGUFReader(target_gguf(model))
    config = head.config
    writer = GGUFWriter(str(out), ARCH)
    writer.add_name(f"EAGLE-3 head for {Path(config.base_model.get('name', 'target')).name}")
    writer.add_uint32(f"{ARCH}.context_length", int(getattr(model.config, "max_position_embeddings", 0) or 32768))
    writer.add_uint32(f"{ARCH}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{ARCH}.block_count", 1)
    writer.add_uint32(f"{ARCH}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{ARCH}.attention.head_count", config.num_attention_heads)
    writer.add_uint32(f"{ARCH}.attention.head_count_kv", config.num_key_value_heads)
    writer.add_uint32(f"{ARCH}.attention.key_length", config.head_dim)
    writer.add_uint32(f"{ARCH}.attention.value_length", config.head_dim)
    writer.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_uint32(f"{ARCH}.rope.dimension_count", config.head_dim)
    writer.add_float32(f"{ARCH}.rope.freq_base", config.rope_theta)
    writer.add_uint32(f"{ARCH}.vocab_size", config.vocab_size)
    writer.add_array(f"{ARCH}.target_layers", engine_aux_ids("llama.cpp", config.aux_layers))
    writer.add_uint32(f"{ARCH}.target_hidden_size", config.hidden_size)
    writer.add_bool(f"{ARCH}.norm_before_residual", False)
    for field in source.fields.values():  # the target's tokenizer, as it is
        if field.name.startswith("tokenizer."):
            array = field.types[0] == GGUFValueType.ARRAY
            writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if array else None)
    tensors = head_tensors(head, DTYPES[dtype])
    for name, tensor in tensors.items():
        if name == "t2d":
            continue  # not read by llama.cpp
        if name == "d2t":  # absolute target ids
            ids = (tensor + torch.arange(tensor.numel())).to(torch.int64).numpy()
            writer.add_tensor("d2t", ids, raw_dtype=GGMLQuantizationType.I64)
            continue
        if name.endswith("q_proj.weight"):
            tensor = interleave_rotary(tensor, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            tensor = interleave_rotary(tensor, config.num_key_value_heads)
        if tensor.dim() == 1:  # norms stay float32, as llama.cpp's converter keeps them
            writer.add_tensor(NAMES[name], tensor.float().numpy())
        else:
            writer.add_tensor(NAMES[name], _raw(tensor), raw_dtype=TYPES[tensor.dtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _raw(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as numpy holds them (bfloat16 as its 16-bit patterns)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy().view(np.uint16)
    return tensor.contiguous().numpy()
