"""A base model's identity: the name users see plus a fingerprint of what adapters and training data depend on
(architecture config and the lm_head weights). Data or an adapter made from one model is refused by another."""

from __future__ import annotations

import hashlib
import json

import torch

# config fields that change what hidden states and logits mean
IDENTITY_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "sliding_window",
)


def model_fingerprint(model) -> str:
    """16 hex digits: SHA-256 over the identity fields of the config and the lm_head weights (as float32 bytes of
    a fixed strided sample of rows, so the value does not depend on the dtype the model was loaded in)."""
    return hf_model_fingerprint(model.hf_model)


def hf_model_fingerprint(hf_model) -> str:
    """`model_fingerprint` of a ``*ForCausalLM`` module (its lm_head's sampled rows must be real, or the fingerprint
    kept as ``hf_model.cats_fingerprint`` before its head began to stream)."""
    kept = getattr(hf_model, "cats_fingerprint", None)
    if kept is not None:
        return kept
    head = hf_model.lm_head
    rows = fingerprint_rows(head.out_features)
    if hasattr(head, "dequantized"):  # a head on GGUF blocks: only the sampled rows, dequantised
        return fingerprint_of(hf_model.config, head.dequantized(rows))
    return fingerprint_of(hf_model.config, head.weight.detach()[rows])


def fingerprint_rows(num_rows: int) -> slice:
    """The lm_head rows the fingerprint reads (about 256, evenly strided)."""
    return slice(None, None, max(1, num_rows // 256))


def fingerprint_of(config, rows: torch.Tensor) -> str:
    """The fingerprint from a config and the sampled lm_head rows (``weight[fingerprint_rows(V)]``), so that it
    can be computed from a checkpoint without loading the model."""
    fields = {key: getattr(config, key, None) for key in IDENTITY_FIELDS}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode())
    rows = rows.to(torch.bfloat16).to(torch.float32)  # bf16: dtype-independent
    digest.update(rows.contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def model_identity(model) -> dict:
    """``{"name", "model_type", "num_layers", "fingerprint"}`` as stored in adapter configs and data folders."""
    return {
        "name": model.name,
        "model_type": model.config.model_type,
        "num_layers": model.num_layers,
        "fingerprint": model_fingerprint(model),
    }
