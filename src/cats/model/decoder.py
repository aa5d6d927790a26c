"""A Llama-family decoder of our own (Llama, Mistral, Qwen2) for GGUF files that run on their blocks.

Why hand-written: transformers' model classes import ``transformers.modeling_utils``, which pulls in torch.distributed,
torch._dynamo, scipy and sympy before a weight is read: 2.5 s on 2 cores and about 100 MiB of anonymous memory
(Qwen2.5-Coder-1.5B's measured runtime: 344 MiB with it, 242 MiB without; docs/memory.md). Under a memory limit
every MiB the runtime holds is a MiB less for resident layers (28.6 MiB is one layer of Qwen2.5-Coder-1.5B Q4_K_M).
A GGUF file on its blocks runs its layers on CATS's own kernels (`cats.model.kernels.layer_forward`), so these classes
are the containers of the file's modules, under transformers' module names (``model.layers.3.self_attn.q_proj``: its
GGUF name map and CATS's kernels find them as in transformers' model), plus the plain forward that runs where no
kernel does (training an adapter copied from a layer, layer skipping, a layer the lean forward does not take). Every
op of that forward, and of the norm and the rotary embedding, is transformers' own, in the same order: the tests
check the outputs bit for bit against transformers' classes.

Only what transformers' Llama, Mistral and Qwen2 classes do for a causal decode is here (`unsupported` names the rest:
those configs load transformers' own classes). There is no ``generate``: CATS's decode loop drives the model.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# model_type -> (bias of q/k/v, bias of o, bias of the MLP): as transformers' classes of that family build them
MODEL_TYPES = {
    "llama": lambda config: (config.attention_bias, config.attention_bias, config.mlp_bias),
    "mistral": lambda config: (False, False, False),
    "qwen2": lambda config: (True, False, False),
}
# rope types whose frequencies are fixed at construction (dynamic and long-context ones update them per forward)
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
# activations as transformers' ACT2FN maps them (``transformers.activations`` itself imports its model-loading code)
ACTIVATIONS = {"silu": nn.SiLU, "swish": nn.SiLU}


def unsupported(config) -> str | None:
    """None where `DecoderForCausalLM` builds this config's model as transformers would, else why not."""
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        return f"model type {model_type!r}"
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r}"
    if getattr(config, "hidden_act", None) not in ACTIVATIONS:
        return f"activation {getattr(config, 'hidden_act', None)!r}"
    if model_type == "qwen2" and getattr(config, "use_sliding_window", False):
        return "Qwen2 with a sliding window"
    return None


def eager_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **_):
    """transformers' eager attention (``repeat_kv``, scores, additive mask, float32 softmax, values)."""
    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


# implementation -> attention function, under the name transformers' modeling files give it (the lean forward looks
# the function up in the module of the attention class: `cats.model.kernels.layer_forward`)
ALL_ATTENTION_FUNCTIONS = {"sdpa": sdpa_attention_forward, "eager": eager_attention_forward}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q and k ``[B, heads, T, D]`` rotated by the rotary embedding's (cos, sin) ``[B, T, D]`` (half-split layout)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (query * cos) + (rotate_half(query) * sin), (key * cos) + (rotate_half(key) * sin)


class DecoderRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden.to(dtype)


class DecoderRotaryEmbedding(nn.Module):
    """(cos, sin) of the rotary embedding for ``position_ids`` ``[B, T]``."""

    def __init__(self, config):
        super().__init__()
        rope = config.rope_parameters
        self.rope_type = rope.get("rope_type", "default")
        if self.rope_type == "default":
            dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_scaling = 1.0
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class DecoderAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        qkv_bias, o_bias, _ = MODEL_TYPES[config.model_type](config)
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        queries, keys = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, queries, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, keys, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, keys, bias=qkv_bias)
        self.o_proj = nn.Linear(queries, config.hidden_size, bias=o_bias)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, cache=None, **_) -> tuple[torch.Tensor, torch.Tensor | None]:
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        query, key = apply_rotary(query, key, *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        out, weights = attend(self, query, key, value, attention_mask,
                              dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


class DecoderMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = MODEL_TYPES[config.model_type](config)[2]
        self.config = config
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = ACTIVATIONS[config.hidden_act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer: ``x + attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = DecoderAttention(config, layer_idx)
        self.mlp = DecoderMLP(config)
        self.input_layernorm = DecoderRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DecoderRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **_) -> torch.Tensor:
        """transformers' keywords (``hidden_states``, ``attention_mask``, ``cache``, ``position_embeddings``; the
        rest it takes are ignored: the mask and the rotary embedding carry the positions)."""
        attended, _ = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache)
        hidden_states = hidden_states + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        # the table as given, not as nn.Embedding initialises it: its normal_ on the meta device imports torch._dynamo
        # (74 MiB of process memory); on the device in force (`skeleton`: meta)
        table = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id, _weight=table)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DecoderRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        with torch.device("cpu"):  # its frequencies are computed here: real even where the parameters are meta
            self.rotary_emb = DecoderRotaryEmbedding(config)


class DecoderForCausalLM(nn.Module):
    """The decoder and its head, as transformers' ``*ForCausalLM`` lays them out (``model``, ``lm_head``, ``config``,
    ``generation_config``). ``config`` is transformers' config of the file (``AutoConfig``); attention runs
    ``config._attn_implementation`` (``sdpa`` or ``eager``). Built under ``torch.device("meta")`` (`skeleton`) its
    parameters are left unallocated; otherwise the embedding table starts as transformers initialises it."""

    def __init__(self, config, attn_implementation: str = "sdpa"):
        super().__init__()
        reason = unsupported(config)
        if reason is not None:
            raise ValueError(f"the decoder does not build {reason}; load transformers' own class for it")
        if attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"attention implementation {attn_implementation!r}: "
                             f"one of {', '.join(ALL_ATTENTION_FUNCTIONS)}")
        config._attn_implementation = attn_implementation
        self.config = config
        self.generation_config = GenerationConfig.from_model_config(config)
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if not self.model.embed_tokens.weight.is_meta:
            self._init_weights(self.model.embed_tokens)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """transformers' initialisation of a fresh module (normal(0, initializer_range) linears and embeddings,
        unit norms), for adapters that start from random weights."""
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, DecoderRMSNorm):
            nn.init.ones_(module.weight)


def skeleton(config, attn_implementation: str = "sdpa") -> nn.Module:
    """The ``*ForCausalLM`` module of ``config`` (float32) with its parameters on the meta device, nothing allocated
    but buffers: `DecoderForCausalLM` where it builds this config (transformers' modeling code, and accelerate, are
    then never imported), else transformers' class."""
    if unsupported(config) is None:
        with torch.device("meta"):  # every parameter; the rotary frequencies are built on the CPU
            return DecoderForCausalLM(config, attn_implementation)
    # only for transformers' classes, whose buffers accelerate keeps real: importing accelerate costs a process 13 MiB
    # of memory (boto3 among its imports), which a memory budget would take from the weights
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
