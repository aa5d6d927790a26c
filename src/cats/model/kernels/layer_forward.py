"""The lean decoder-layer forward: the same math as a transformers pre-norm decoder layer, in fewer, larger ops.

On a CPU a small model's decode step is dominated by per-op overhead, not arithmetic (docs/performance.md). This
forward runs a Llama, Mistral, Qwen2, Qwen3 or Phi3 decoder layer from the layer's own HF modules and parameters
(norms, projections, activation, the model's attention function: the HF modules stay the source of truth) and
differs from the module's ``forward`` only in how the work is grouped:

* **attention without GQA overhead for few queries**: up to 8 query tokens have their heads packed per KV head
  (``[B, kv_heads, groups * T, D]``, the mask's rows repeated per group), as transformers' own ``pack_gqa`` does
  for one token when it does not take SDPA's ``enable_gqa`` path, which on this CPU costs 3-7x more for one token
  (SmolLM2 bf16, 300 cached tokens: a one-token forward 24.4 against 29.6 ms, 2-8 tokens ~2.7 ms less);
* **fused projections on packed weights**: with ``--pack-weights`` (`cats.model.kernels.packing.pack_linears`) q, k and v run
  as one prepacked GEMM, and so do gate and up (one packed copy of the concatenated weights replaces the separate
  packed copies); without packing each projection is its module's own call;
* **q and k rotated in one pass** when they come out of one fused GEMM;
* the KV cache write goes straight to the layer's cache, and no attention weights or unused outputs are built.

Outputs: everything but the packed few-query attention is bit-identical to the module's forward (SmolLM2 bf16:
prefill, one-token and 16-token forwards). The packed attention computes the same attention but rounds differently
at some steps (SmolLM2 bf16: with one and two queries; four and eight were bit-identical). In float32 no greedy
answer changed (8 MT-Bench answers x 96 tokens, all equal to transformers'); in bf16 4 of those 8 answers differ
from transformers' bf16 greedy from some token on. ``CATS_LEAN=exact`` (or ``LayeredModel.exact_attention = True``)
keeps transformers' attention call there: the output is then transformers' bf16 greedy output token for token, at
1.5-5 ms more per SmolLM2 step. Every method runs
on the same forward, so speculative decoding reproduces plain greedy decoding token for token either way (the
lossless tests run on this path; transformers' own ``generate`` never does, so the references stay independent).

`LayeredModel.lean` switches the whole forward (default on; ``CATS_LEAN=0`` in the environment turns it off).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Sequence

import torch
from torch import nn

from cats.model.kernels import avx512, quantized
from cats.model.kernels.gguf_modules import GGUFLinear, fused_gguf_linear, layer_groups
from cats.model.kernels.packing import (
    LAYER_SPECS,
    fused_copy,
    fused_linear,
    is_packed,
    panel_copy,
)

# decoder layer classes whose forward is exactly: x + attn(input_layernorm(x)); x + mlp(post_attention_layernorm(x))
# (``DecoderLayer``: CATS's own Llama-family layer, `cats.model.decoder`)
LEAN_LAYER_CLASSES = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                                "Phi3DecoderLayer", "DecoderLayer"})
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


def lean_default() -> bool:
    """Whether new models run the lean forward: yes, unless ``CATS_LEAN`` is ``0``/``false``/``off``."""
    return os.environ.get("CATS_LEAN", "1").strip().lower() not in ("0", "false", "off", "no")


def exact_attention_default() -> bool:
    """Whether the lean forward keeps transformers' attention call for few queries (``CATS_LEAN=exact``): slower,
    but bf16 greedy output then equals transformers' token for token (the packed form rounds differently in bf16 at
    some steps: 4 of 8 MT-Bench answers of 96 tokens differed from transformers' bf16 greedy, none in float32)."""
    return os.environ.get("CATS_LEAN", "1").strip().lower() == "exact"


def lean_unsupported(layer: nn.Module) -> str | None:
    """None if `lean_layer_forward` can run ``layer``, else why not."""
    name = type(layer).__name__
    if name not in LEAN_LAYER_CLASSES:
        return f"{name} has no lean forward"
    attention = layer.self_attn
    implementation = attention.config._attn_implementation
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        return f"attention implementation {implementation!r}"
    if layer.training:
        return "training mode"
    mlp = layer.mlp
    if name == "Phi3DecoderLayer":
        if not (hasattr(attention, "qkv_proj") and hasattr(mlp, "gate_up_proj")):
            return "Phi3 layer without fused qkv_proj / gate_up_proj"
    elif not all(hasattr(attention, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")) or not all(
            hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
        return f"{name} without the usual projections"
    return None


_ROTARY_MEMO: list = [(None, None, None)]  # [(cos, sin, their lean form)] of the latest forward: built once, not per
# layer (one tuple, swapped whole: a thread reads a consistent entry)


def _rotary_parts(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, signed sin)`` as ``[B, 1, T, R]``, where signed sin is ``[-sin_1, sin_2]`` over the two halves, so that
    ``rotate_half(x) * sin == x.roll(R / 2) * signed`` bit for bit (a sign flip is exact). Memoised on the identity
    of the (cos, sin) pair, which every layer of a forward shares (the memo holds them: no identity reuse)."""
    entry = _ROTARY_MEMO[0]
    if entry[0] is cos and entry[1] is sin:
        return entry[2]
    half = sin.shape[-1] // 2
    parts = cos.unsqueeze(1), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)
    _ROTARY_MEMO[0] = (cos, sin, parts)
    return parts


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding, ``x * cos + rotate_half(x) * sin`` over the first ``R = cos.shape[-1]`` dims
    (the rest passes through, as in Phi3's partial rotary), for ``x`` ``[B, heads, T, D]`` and the parts of
    `_rotary_parts`."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + x.roll(rotary // 2, -1) * signed_sin
    part, rest = x[..., :rotary], x[..., rotary:]
    return torch.cat([part * cos + part.roll(rotary // 2, -1) * signed_sin, rest], dim=-1)


PACKED_QUERY_LIMIT = 32  # up to this many queries the packed attention is cheaper (bf16, 300 cached tokens, whole
# forward with the AVX-512 linears: 1.0 ms less at 8 to 32 queries than with the limit at 8)
_MASK_MEMO: list = [(None, 0, None)]  # [(mask, groups, its rows repeated per group)], as for the rotary parts


def _grouped_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """The additive mask ``[B, 1, T, S]`` with its rows repeated per query group, ``[B, 1, groups * T, S]`` (row
    ``g * T + t`` = row t), the layout of a packed query; built once per forward (memoised on the mask's identity)."""
    entry = _MASK_MEMO[0]
    if entry[0] is mask and entry[1] == groups:
        return entry[2]
    batch, _, length, size = mask.shape
    grouped = mask[:, :, None].expand(batch, 1, groups, length, size).reshape(batch, 1, groups * length, size)
    _MASK_MEMO[0] = (mask, groups, grouped)
    return grouped


# RMSNorm classes whose forward is exactly Llama's: w * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)
LEAN_NORM_CLASSES = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm",
                               "DecoderRMSNorm"})


def _norm(norm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``norm(hidden)``: for Llama-style RMSNorms the same ops in the same order, with in-place intermediates
    (bit-identical, ~25 % cheaper per call); any other norm runs its own forward."""
    if type(norm).__name__ not in LEAN_NORM_CLASSES:
        return norm(hidden)
    x = hidden.to(torch.float32)
    scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(norm.variance_epsilon))
    x = x * scale if x is hidden else x.mul_(scale)  # in place only on the float32 copy, never on the input
    return norm.weight * x.to(hidden.dtype)


def _projections(layer: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor | None, int, int]:
    """``(qkv [B, T, (Hq + 2 Hk) D], q width, k width)`` from one GEMM (Phi3's fused qkv_proj, or packed q/k/v fused
    by `fused_linear`); ``(None, 0, 0)`` where q, k and v must run as their own modules.

    (Submodules are looked up in ``_modules``: ``hasattr`` on a missing one raises inside ``nn.Module`` and costs
    ~2 µs, per layer and forward.)"""
    attention = layer.self_attn
    qkv_proj = attention._modules.get("qkv_proj")
    if qkv_proj is not None:  # Phi3: fused in the checkpoint
        q_width = attention.config.num_attention_heads * attention.head_dim
        return qkv_proj(hidden), q_width, attention.num_key_value_heads * attention.head_dim
    parts = (attention.q_proj, attention.k_proj, attention.v_proj)
    fused = fused_gguf_linear(hidden, parts) if isinstance(parts[0], GGUFLinear) else fused_linear(hidden, parts)
    if fused is None:
        return None, 0, 0
    return fused, parts[0].out_features, parts[1].out_features


_FLOAT_MASK_MEMO: list = [(None, None)]  # [(mask, its [T, S] float32 form)], as for the rotary parts


def _float_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The additive mask ``[1, 1, T, S]`` as float32 ``[T, S]`` for `avx512.attention`, once per forward."""
    if mask is None:
        return None
    entry = _FLOAT_MASK_MEMO[0]
    if entry[0] is mask:
        return entry[1]
    converted = mask[0, 0].to(torch.float32).contiguous()
    _FLOAT_MASK_MEMO[0] = (mask, converted)
    return converted


def _attention_function(attention: nn.Module, implementation: str):
    """What the attention module itself would call: the eager function or the registered ``implementation`` of its
    modeling file (transformers' files and `cats.model.decoder` name them alike; looked up there, so that this
    module never imports transformers' modeling code)."""
    modeling = sys.modules[type(attention).__module__]
    if implementation == "eager":
        return modeling.eager_attention_forward
    return modeling.ALL_ATTENTION_FUNCTIONS[implementation]


def lean_layer_forward(layer: nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                       position_embeddings: tuple[torch.Tensor, torch.Tensor], cache,
                       pack_queries: bool = True, kernels: bool = False) -> torch.Tensor:
    """One decoder layer (see the module docstring) on ``hidden`` ``[B, T, H]``; appends the T tokens' K/V to
    ``cache`` (a transformers cache) at the layer's index. ``attention_mask`` is the additive float mask
    ``[B, 1, T, P + T]`` or None (every slot visible), ``position_embeddings`` the model's rotary (cos, sin).
    ``pack_queries=False`` keeps transformers' own attention call for few queries too (its exact rounding).
    ``kernels=True`` (a packed model) runs attention on the row-invariant AVX-512 kernel where it runs (not with
    ``pack_queries=False``), `avx512.ATTENTION_QUERY_LIMIT` queries at a time."""
    attention, mlp = layer.self_attn, layer.mlp
    batch, length, _ = hidden.shape
    dim = attention.head_dim
    normed = _norm(layer.input_layernorm, hidden)
    qkv, q_width, k_width = _projections(layer, normed)
    cos, sin = _rotary_parts(*position_embeddings)
    q_norm = attention._modules.get("q_norm")  # Qwen3: per-head RMSNorm of q and k before the rotary embedding
    if qkv is not None and q_norm is None:  # q and k side by side: rotate them in one pass
        query_key = qkv[..., : q_width + k_width].view(batch, length, -1, dim).transpose(1, 2)
        query_key = _rotate(query_key, cos, sin)
        query, key = query_key[:, : q_width // dim], query_key[:, q_width // dim:]
        value = qkv[..., q_width + k_width:].view(batch, length, -1, dim).transpose(1, 2)
    else:
        if qkv is not None:
            query, key, value = qkv.split([q_width, k_width, qkv.shape[-1] - q_width - k_width], dim=-1)
        else:
            query, key, value = attention.q_proj(normed), attention.k_proj(normed), attention.v_proj(normed)
        query, key = query.view(batch, length, -1, dim), key.view(batch, length, -1, dim)
        if q_norm is not None:
            query, key = _norm(q_norm, query), _norm(attention.k_norm, key)
        query = _rotate(query.transpose(1, 2), cos, sin)
        key = _rotate(key.transpose(1, 2), cos, sin)
        value = value.view(batch, length, -1, dim).transpose(1, 2)
    key, value = cache.update(key, value, attention.layer_idx)
    groups = query.shape[1] // key.shape[1]
    implementation = attention.config._attn_implementation
    if kernels and pack_queries and avx512.attention_usable(query, key, attention_mask):
        out = avx512.attention(query, key, value, _float_mask(attention_mask), attention.scaling)
    elif (pack_queries and implementation == "sdpa" and groups > 1 and length <= PACKED_QUERY_LIMIT
            and (attention_mask is not None or length == 1)):
        # few queries: their heads packed per KV head, [B, kv_heads, groups * T, D] (transformers' pack_gqa, which it
        # uses only without enable_gqa), the mask's rows repeated per group
        packed_mask = None if attention_mask is None else _grouped_mask(attention_mask, groups)
        out = nn.functional.scaled_dot_product_attention(
            query.reshape(batch, key.shape[1], groups * length, dim), key, value, attn_mask=packed_mask,
            scale=attention.scaling)
        out = out.reshape(batch, query.shape[1], length, dim).transpose(1, 2).reshape(batch, length, -1)
    else:
        attend = _attention_function(attention, implementation)
        # (no sliding_window argument: the mask carries the window, and sdpa and eager attention ignore it)
        out, _ = attend(attention, query, key, value, attention_mask, dropout=0.0, scaling=attention.scaling)
        out = out.reshape(batch, length, -1)
    hidden = hidden + attention.o_proj(out)
    normed = _norm(layer.post_attention_layernorm, hidden)
    gate_up_proj = mlp._modules.get("gate_up_proj")
    if gate_up_proj is not None:  # Phi3
        gate, up = gate_up_proj(normed).chunk(2, dim=-1)
        activation = mlp.activation_fn
    else:
        parts = (mlp.gate_proj, mlp.up_proj)
        fused = fused_gguf_linear(normed, parts) if isinstance(parts[0], GGUFLinear) else fused_linear(normed, parts)
        gate, up = fused.chunk(2, dim=-1) if fused is not None else (mlp.gate_proj(normed), mlp.up_proj(normed))
        activation = mlp.act_fn
    return hidden + mlp.down_proj(activation(gate) * up)


# ---------------------------------------------------------------------------------------------------------------
# The whole layer in one kernel call (`avx512.layer`): for a packed model on the AVX-512 kernels, or a model on GGUF
# blocks, a Llama-style layer over a few tokens (decode steps, drafts, verifications) runs as one C function instead
# of ~40 torch ops and five kernel calls; the linears and attention are the same kernels, so it stays row-invariant.

FUSED_LAYER_CLASSES = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "DecoderLayer"})


def fused_unsupported(layer: nn.Module) -> str | None:
    """None if `fused_layer_forward` can run ``layer`` (once packed, or on GGUF blocks), else why not."""
    reason = lean_unsupported(layer)
    if reason is not None:
        return reason
    name = type(layer).__name__
    if name not in FUSED_LAYER_CLASSES:
        return f"{name} has no whole-layer kernel"
    attention, mlp = layer.self_attn, layer.mlp
    if attention._modules.get("q_norm") is not None:
        return "per-head q/k norms"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(norm).__name__ not in LEAN_NORM_CLASSES for norm in norms):
        return "not a Llama-style RMSNorm"
    if getattr(mlp.config, "hidden_act", None) not in ("silu", "swish"):
        return f"activation {getattr(mlp.config, 'hidden_act', None)!r}"
    dim, heads = attention.head_dim, attention.config.num_attention_heads
    if dim % 16 or dim > 256 or heads % attention.config.num_key_value_heads:  # (bf16: dim % 32, checked per call)
        return f"head size {dim}"
    return None


def whole_layer_forward(layers, dtype) -> bool:
    """Whether every forward of ``layers`` (a model on GGUF blocks, or packed) runs on the whole-layer kernel here: the
    lean forward without transformers' attention (``CATS_LEAN``), the kernels built for ``dtype``, every layer one
    that `fused_layer_forward` runs (`fused_unsupported`)."""
    return (lean_default() and not exact_attention_default() and avx512.layer_ready(dtype)
            and all(fused_unsupported(layer) is None for layer in layers))


def _layer_parts(layer: nn.Module) -> tuple:
    """The modules `_layer_spec` reads: the two norms, q, k, v, o, gate, up, down (looked up in ``_modules``: ~1 µs,
    on every call)."""
    modules = layer._modules
    attention, mlp = modules["self_attn"]._modules, modules["mlp"]._modules
    return (modules["input_layernorm"], modules["post_attention_layernorm"], attention["q_proj"], attention["k_proj"],
            attention["v_proj"], attention["o_proj"], mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"])


def _parts_key(parts: tuple) -> list:
    """What identifies the parts' weights and biases: each tensor's storage and version (as `packing._weight_key`,
    written out in one comprehension: it runs for every layer of every forward, right after the weights have pushed
    the interpreter's data out of the caches)."""
    return [(tensor.data_ptr(), None if tensor.is_inference() else tensor._version)
            for module in parts for tensor in module._parameters.values() if tensor is not None]


def _layer_spec(layer: nn.Module, dtype: torch.dtype):
    """The layer's `avx512.LayerSpec` over its packed copies or its GGUF blocks (float32), or None if a linear is
    neither or a weight is not ``dtype``; kept in `lean.LAYER_SPECS` with what it points to, made again whenever a weight or bias changed
    (checked on every call: the same modules, their tensors' storage and version; ~3 µs)."""
    entry = LAYER_SPECS.get(layer)
    parts = _layer_parts(layer)
    key = _parts_key(parts)
    if entry is not None and entry[1] == parts and entry[2] == key:
        return entry[0]
    first_norm, second_norm, linears = parts[0], parts[1], parts[2:]
    norms = (first_norm.weight, second_norm.weight)
    if any(w.dtype != dtype for w in norms):
        return None
    norms = tuple(norm.detach().contiguous() for norm in norms)
    attention = layer.self_attn
    config = attention.config
    shapes = dict(H=config.hidden_size, Hq=config.num_attention_heads, Hk=config.num_key_value_heads,
                  D=attention.head_dim, inter=linears[4].out_features, eps1=first_norm.variance_epsilon,
                  eps2=second_norm.variance_epsilon, scale=attention.scaling, ln1=norms[0].data_ptr(),
                  ln2=norms[1].data_ptr())
    groups = layer_groups(linears) if dtype == torch.float32 else None
    if groups is not None:  # GGUF blocks: the kernel calls the quantised kernels' team function for the linears
        qkv, o, gate_up, down, qk_order = groups
        address = ctypes.addressof
        spec = avx512.LayerSpec(bf16=0, **shapes, qkv=address(qkv.spec), o=address(o.spec),
                                gate_up=address(gate_up.spec), down=address(down.spec),
                                blocks=quantized.team_function(),
                                qk_order=None if qk_order is None else qk_order.data_ptr())
        LAYER_SPECS[layer] = (spec, parts, key, (norms, groups))
        return spec
    if not all(is_packed(module) for module in linears):
        return None
    qkv, gate_up = fused_copy(linears[:3], dtype, True), fused_copy(linears[4:6], dtype, True)
    if qkv is None or gate_up is None:
        return None
    _, o, o_bias = panel_copy(linears[3])
    _, down, down_bias = panel_copy(linears[6])
    pointer = lambda tensor: None if tensor is None else tensor.data_ptr()  # noqa: E731
    spec = avx512.LayerSpec(
        bf16=int(dtype == torch.bfloat16), **shapes, qkv=qkv[1].data_ptr(), qkv_bias=pointer(qkv[2]),
        o=o.data_ptr(), o_bias=pointer(o_bias), gate_up=gate_up[1].data_ptr(), gate_up_bias=pointer(gate_up[2]),
        down=down.data_ptr(), down_bias=pointer(down_bias))
    LAYER_SPECS[layer] = (spec, parts, key, (norms, qkv, gate_up, o, o_bias, down, down_bias))
    return spec


def fused_ready(hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], head_dim: int) -> bool:
    """Whether `fused_layer_forward` can run a forward of ``hidden`` ``[1, T, H]`` here (checked once per forward):
    one sequence, contiguous, a rotary over the whole head in the model's
    dtype, a mask unless T is 1, no autograd, the kernels built for the dtype (bf16: head size a multiple of 32)."""
    batch, length, _ = hidden.shape
    cos = position_embeddings[0]
    return (batch == 1 and cos.shape[-1] == head_dim
            and hidden.is_contiguous() and (attention_mask is not None or length == 1)
            and not torch.is_grad_enabled() and cos.dtype == hidden.dtype
            and not (head_dim % 32 and hidden.dtype == torch.bfloat16) and avx512.layer_ready(hidden.dtype))


def fused_layer_forward(layer: nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                        position_embeddings: tuple[torch.Tensor, torch.Tensor], cache) -> bool:
    """Run ``layer`` (`fused_unsupported` None) on ``hidden`` ``[1, T, H]`` **in place** through `avx512.layer`,
    appending the tokens' K/V to ``cache`` (a transformers cache of `SlotLayer`\\ s) at the layer's index, where
    `fused_ready` holds for the forward; False (and nothing done) if the layer's linears are not packed."""
    spec = _layer_spec(layer, hidden.dtype)
    if spec is None:
        return False
    length = hidden.shape[1]
    slot = cache.layers[layer.self_attn.layer_idx]
    keys, values, past = slot.reserve(length, spec.Hk, spec.D, hidden.dtype)
    cos, sin = position_embeddings
    mask = _float_mask(attention_mask)
    for first, last, seen in avx512.query_chunks(length, past + length, mask):  # later chunks read earlier ones' K/V
        avx512.layer(spec, hidden[:, first:last], cos[:, first:last], sin[:, first:last], keys, values, past + first,
                     None if mask is None else mask[first:last, :seen])
    slot._set_length(past + length)
    return True


def fused_layers_forward(layers: Sequence[nn.Module], hidden: torch.Tensor,
                         attention_masks: Sequence[torch.Tensor | None],
                         position_embeddings: Sequence[tuple[torch.Tensor, torch.Tensor]], cache) -> bool:
    """`fused_layer_forward` for consecutive ``layers`` in one C call (`avx512.layers`), layer i with
    ``attention_masks[i]`` and ``position_embeddings[i]``, where ``hidden`` is at most `avx512.ATTENTION_QUERY_LIMIT`
    tokens: a decode step or a verification without a return to Python between its layers. False (and nothing done)
    if one layer's linears are not packed, or the forward is longer."""
    length = hidden.shape[1]
    if length > avx512.ATTENTION_QUERY_LIMIT:
        return False
    specs = [_layer_spec(layer, hidden.dtype) for layer in layers]
    if any(spec is None for spec in specs):
        return False
    slots = [cache.layers[layer.self_attn.layer_idx] for layer in layers]
    caches = [slot.reserve(length, spec.Hk, spec.D, hidden.dtype) for slot, spec in zip(slots, specs)]
    avx512.layers(specs, hidden, position_embeddings, caches, [_float_mask(mask) for mask in attention_masks])
    for slot, (_, _, past) in zip(slots, caches):
        slot._set_length(past + length)
    return True
