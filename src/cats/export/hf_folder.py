"""The vLLM and SGLang layout of an EAGLE-3 head: an HF folder (``config.json`` + ``model.safetensors``) whose
tensor names and config keys are those their EAGLE-3 loaders read (`cats.export.layout`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from cats.export.layout import ARCHITECTURES, engine_aux_ids
from cats.model import LayeredModel
from cats.model.eagle3 import Eagle3Head

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def head_tensors(head: Eagle3Head, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's tensors under the EAGLE-3 checkpoint names, with its read-out: ``lm_head.weight`` (the target's
    rows of the draft vocabulary, or its whole lm_head) and, with a reduced vocabulary, ``d2t`` and ``t2d``."""
    tensors = {name: value.detach().to(dtype).contiguous() for name, value in head.state_dict().items()
               if name != "vocab_ids"}
    if head.vocab_ids is None:
        tensors["lm_head.weight"] = head.target.hf_model.lm_head.weight.detach().to(dtype).contiguous()
        return tensors
    ids = head.vocab_ids.cpu()
    tensors["lm_head.weight"] = head.vocabulary_rows().detach().to(dtype).contiguous()
    tensors["d2t"] = ids - torch.arange(ids.numel())
    selected = torch.zeros(head.config.vocab_size, dtype=torch.bool)
    selected[ids] = True
    tensors["t2d"] = selected
    return tensors


def engine_config(head: Eagle3Head, model: LayeredModel, engine: str, dtype: str) -> dict:
    """The ``config.json`` ``engine`` reads: a one-layer Llama with the EAGLE-3 keys."""
    config = head.config
    aux = engine_aux_ids(engine, config.aux_layers)
    layout = {
        "architectures": [ARCHITECTURES[engine]],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "target_hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": int(getattr(model.config, "max_position_embeddings", 0) or 32768),
        "vocab_size": config.vocab_size,
        "draft_vocab_size": len(config.vocab_subset) if config.vocab_subset else config.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        "eagle_config": {"use_aux_hidden_state": True},
        "cats": {"base_model": config.base_model, "aux_layers_after": config.aux_layers, "exported_for": engine},
    }
    if engine == "vllm":
        layout["eagle_aux_hidden_state_layer_ids"] = aux
    else:
        layout["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = aux
    return layout


def write_hf_folder(head: Eagle3Head, model: LayeredModel, engine: str, out: Path, dtype: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file(head_tensors(head, DTYPES[dtype]), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(engine_config(head, model, engine, dtype), indent=2) + "\n")
    return out
