"""Estimates of a pass's transient memory from the model's config, for the planner (`cats.model.weights.budget`): the
KV cache it reserves and the activations of the largest pass.

Two forwards are priced. Through the model's modules (float weights), SDPA materialises every query's scores over the
context and the K/V expanded to all heads, and the MLP's intermediates exist for every token at once. On the
whole-layer kernel (`cats.model.kernels.layer_forward.fused_layer_forward`: GGUF blocks) a layer runs in place on the
hidden states, at most `ATTENTION_QUERY_LIMIT` tokens a call, with its intermediates in one scratch buffer of that
many tokens and the scores of one query at a time; what grows with a prompt is the hidden states and the additive
mask. Measured on Qwen2.5-Coder-1.5B's GGUF (2026-12-06, the resident model's high-water above its KV cache, the
scratch held from before): prompts of 201 / 709 / 1,400 tokens 5.2 / 13.2 / 26.8 MiB, which the whole-layer
estimate prices at 9.8 / 36.3 / 76.3 MiB with the scratch (8.6 MiB) and the logits left out, and the modules' at
39.8 / 174.6 / 437.1. A verification pass (tens of tokens, each with its logits) is priced through the modules
(`tests/test_gguf_offload.py` checks a prompt and 17-token passes on SmolLM2's file)."""

from __future__ import annotations

from cats.model.kernels.avx512 import ATTENTION_QUERY_LIMIT

HIDDEN_COPIES = 8  # hidden states a forward holds at once: its input, the kernel's in-place copy, norms, captures
PROMPT_COPIES = 4  # on the whole-layer kernel, a prompt that no drafter captures states of: its embedded input, the
# kernel's in-place copy, the final states, one spare. Measured on Qwen2.5-Coder-1.5B's GGUF (2026-12-06, `ar` and
# `dytc` under a budget, the high-water above the KV cache written, less the mask): 0.9-3.1 copies at 200-2,000 tokens;
# with the EAGLE-3 head's captures (three layers' states, fused) ~76 MiB at 1,400 tokens, within the 8 copies' 87
PROMPT_CHUNK = 512  # tokens a forward of a prompt whose length the plan cannot know (`cats serve`, `cats chat`) takes
# under a budget where no drafter keeps its states (`MemoryNeeds.prompt_chunk`): its activations are priced for this
# many; a longer prompt costs one more sweep of the streamed layers per chunk (llama.cpp's default micro-batch)
LOGIT_COPIES = 3  # a pass's float32 logits, and what sampling and the drafters hold beside them: on SmolLM2 (float
# path, 17-token passes, 2026-12-06) a greedy one peaked at 1.8 rows of V per token, a sampled EAGLE tree at 3.4


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_cache_bytes(config, itemsize: int, tokens: int, extra_layers: int = 0) -> int:
    """K and V for ``tokens`` slots in every layer (sliding-window layers too: CATS's cache keeps full history)."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = 2 * kv_heads * _head_dim(config) * itemsize
    return per_token * tokens * (config.num_hidden_layers + extra_layers)


def layer_scratch_bytes(config, tokens: int, itemsize: int = 4) -> int:
    """The whole-layer kernel's scratch for ``tokens`` tokens (``cats_layer_scratch`` in ``avx512.c``): two hidden
    rows, q/k/v, the attention output and its projection's input, and gate, up and their product per token."""
    query_width = config.num_attention_heads * _head_dim(config)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    width = query_width + 2 * kv_heads * _head_dim(config)
    return tokens * (2 * config.hidden_size + width + 2 * query_width + 3 * config.intermediate_size) * itemsize


def activation_bytes(config, itemsize: int, tokens: int, context_tokens: int, logit_rows: int | None = None,
                     fused: bool = False, captures: bool = True) -> int:
    """An upper estimate of the transient tensors of one pass over ``tokens`` new tokens with ``context_tokens``
    cached, plus logits with their float copies (``LOGIT_COPIES x rows x V``, float32; rows = T by default, 1 for a
    prefill).

    Through the modules (``fused`` False): hidden states and norms (~8 x T x H), the MLP (3 x T x I), q/k/v and the
    K/V expanded to all heads for a masked SDPA (2 x heads x ctx x head_dim), attention scores and their softmax
    (2 x heads x T x ctx), the additive mask (T x ctx). On the whole-layer kernel (``fused``): the kernel's scratch
    for one call (at most `ATTENTION_QUERY_LIMIT` tokens), the hidden states (8 x T x H; `PROMPT_COPIES` x T x H
    without ``captures``: no drafter keeps layers' states of these tokens), the additive mask and the bool one it is
    made from (T x ctx, 4 + 1 bytes) and the rotary tables (2 x T x head_dim)."""
    heads, head_dim = config.num_attention_heads, _head_dim(config)
    t, ctx = tokens, context_tokens + tokens
    if fused:
        forward = (layer_scratch_bytes(config, min(t, ATTENTION_QUERY_LIMIT), itemsize)
                   + ((HIDDEN_COPIES if captures else PROMPT_COPIES) * t * config.hidden_size + 2 * t * head_dim) * itemsize
                   + t * ctx * (itemsize + 1))
    else:
        forward = (HIDDEN_COPIES * t * config.hidden_size + 3 * t * config.intermediate_size + 3 * t * heads * head_dim
                   + 2 * heads * ctx * head_dim + 2 * heads * t * ctx + t * ctx) * itemsize
    logits = LOGIT_COPIES * (t if logit_rows is None else logit_rows) * config.vocab_size * 4
    return forward + logits


def prompt_chunk(needs) -> int:
    """Tokens a prompt runs a forward under a `MemoryNeeds`: its ``prompt_chunk`` where that applies (no drafter
    keeps the prompt's states), 0 = all at once."""
    return 0 if needs.prompt_captures else needs.prompt_chunk


def prompt_forward_tokens(needs) -> tuple[int, int]:
    """``(prompt, tokens one forward of it takes)`` for a `MemoryNeeds`: the longest prompt (the context where it is
    not known) and `prompt_chunk` of it, or all of it."""
    prompt, chunk = needs.prompt_tokens or needs.context_tokens, prompt_chunk(needs)
    return prompt, min(prompt, chunk) if chunk else prompt


def prompt_text(needs) -> str:
    """The prompt a plan prices, e.g. ``2048-token prompt, 512 a forward``."""
    prompt, chunk = prompt_forward_tokens(needs)
    return f"{prompt}-token prompt" + (f", {chunk} a forward" if chunk < prompt else "")
