"""Estimates of a pass's transient memory from the model's config, for the planner (`cats.model.weights.budget`): the
KV cache it reserves and the activations of the largest pass."""

from __future__ import annotations


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_cache_bytes(config, itemsize: int, tokens: int, extra_layers: int = 0) -> int:
    """K and V for ``tokens`` slots in every layer (sliding-window layers too: CATS's cache keeps full history)."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = 2 * kv_heads * _head_dim(config) * itemsize
    return per_token * tokens * (config.num_hidden_layers + extra_layers)


def activation_bytes(config, itemsize: int, tokens: int, context_tokens: int, logit_rows: int | None = None) -> int:
    """An upper estimate of the transient tensors of one pass over ``tokens`` new tokens with ``context_tokens``
    cached: hidden states and norms (~8 x T x H), the MLP (3 x T x I), q/k/v and the K/V expanded to all heads
    for a masked SDPA (2 x heads x ctx x head_dim), attention scores and their softmax (2 x heads x T x ctx), the
    additive mask (T x ctx), and logits with their float softmax copies (3 x rows x V, float32; rows = T by
    default, 1 for a prefill)."""
    heads, head_dim = config.num_attention_heads, _head_dim(config)
    t, ctx = tokens, context_tokens + tokens
    per_layer = (8 * t * config.hidden_size + 3 * t * config.intermediate_size + 3 * t * heads * head_dim
                 + 2 * heads * ctx * head_dim + 2 * heads * t * ctx + t * ctx) * itemsize
    logits = 3 * (t if logit_rows is None else logit_rows) * config.vocab_size * 4
    return per_layer + logits
