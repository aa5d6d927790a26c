"""A decoder driven layer range by layer range over one shared KV cache: transformers' ``*ForCausalLM``, or for a GGUF
file on its blocks CATS's own Llama-family decoder with the same module names (`cats.model.decoder`).

The math is the model's own: its embedding, decoder layers (attention included), rotary embedding, final norm
and lm_head modules. This module only decides which layers run on which tokens, at which positions, with which
cache slots visible (the attention mask).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from cats.errors import UnsupportedArchitectureError
from cats.model.cache import KVCache
from cats.model.kernels import avx512
from cats.model.kernels.gguf_modules import GGUFEmbedding, GGUFLinear, kernel_path
from cats.model.kernels.layer_forward import (
    exact_attention_default,
    fused_layer_forward,
    fused_layers_forward,
    fused_ready,
    fused_unsupported,
    lean_default,
    lean_layer_forward,
    lean_unsupported,
)

# model_type -> family name shown to users. All of them keep their decoder in `model.model.layers`, the rotary
# embedding in `model.model.rotary_emb`, the final norm in `model.model.norm` and the head in `model.lm_head`.
SUPPORTED_MODEL_TYPES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma3_text": "Gemma3 (text)",
    "phi3": "Phi3",
}

FULL = "full_attention"
SLIDING = "sliding_attention"


def check_supported(config) -> None:
    """Raise `UnsupportedArchitectureError` unless CATS can drive this config's architecture."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        hint = ""
        if model_type == "gemma3":
            hint = " (for Gemma3 use a text-only checkpoint, model_type 'gemma3_text')"
        raise UnsupportedArchitectureError(
            f"unsupported architecture {model_type!r}{hint}; CATS supports "
            + ", ".join(f"{name} ({key})" for key, name in SUPPORTED_MODEL_TYPES.items())
        )


def layer_types_of(config) -> list[str]:
    """Attention kind of every decoder layer: full, or sliding window of ``config.sliding_window`` tokens."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types:
        return [SLIDING if t == SLIDING else FULL for t in types[:n]]
    # Mistral and Phi3 use one sliding window for every layer when `sliding_window` is set.
    if getattr(config, "sliding_window", None) and config.model_type in ("mistral", "phi3"):
        return [SLIDING] * n
    return [FULL] * n


def eos_token_ids(generation_config, config, tokenizer) -> set[int]:
    """End-of-sequence ids from the generation config (which may list several), else the model config, else the
    tokenizer."""
    ids: set[int] = set()
    for source in (generation_config, config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
            break
    if not ids and tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@dataclass
class LayeredModel:
    """A loaded target model that runs any layer range ``[start, end)`` on hidden states.

    Attributes:
        hf_model: the ``*ForCausalLM`` module, transformers' or `cats.model.decoder`'s (weights live here, loaded
            once).
        tokenizer: its tokenizer, with the chat template.
        name: where the model came from (path or Hub id), for reports.
        weights: under a memory budget, the `cats.model.weights.LayerStreamer` that makes streamed layers' parameters
            real around each use (None: every layer is resident).
        memory_plan: the `cats.model.weights.MemoryPlan` it runs under (None: no budget).
    """

    hf_model: torch.nn.Module
    tokenizer: object = None
    name: str = ""
    weights: object = None
    memory_plan: object = None

    def __post_init__(self):
        check_supported(self.hf_model.config)
        self.hf_model.eval()
        self.config = self.hf_model.config
        embedding = self.hf_model.model.embed_tokens
        self._gguf = isinstance(embedding, GGUFEmbedding)
        self.decoder = self.hf_model.model
        self.layers = self.decoder.layers
        self.num_layers = self.config.num_hidden_layers
        self.layer_types = layer_types_of(self.config)
        self.sliding_window = getattr(self.config, "sliding_window", None)
        rotary_params = inspect.signature(self.decoder.rotary_emb.forward).parameters
        self._rotary_per_layer_type = "layer_type" in rotary_params
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        self.packed = False  # bf16 linears routed through prepacked oneDNN weights (`cats.model.kernels.packing.pack_linears`)
        self.large_pages = None  # a GGUF file's mapping in 2 MiB pages at load (`cats.model.weights.large_pages`)
        # the lean layer forward (`cats.model.kernels.layer_forward`) where the layer class has one; set False for the modules'
        # own forward (default: on unless CATS_LEAN=0)
        self.lean = lean_default()
        self.exact_attention = exact_attention_default()  # lean, but transformers' single-query attention (CATS_LEAN=exact)
        self._lean_layers = [lean_unsupported(layer) is None for layer in self.layers[: self.num_layers]]
        # layers the whole-layer kernel can run once packed or on GGUF blocks (`cats.model.kernels.layer_forward.fused_layer_forward`)
        self._fused_layers = [fused_unsupported(layer) is None for layer in self.layers[: self.num_layers]]
        self._fused_head_dim = next((layer.self_attn.head_dim for layer, fused in zip(self.layers, self._fused_layers)
                                     if fused), 0)

    def attach_weights(self, weights, plan) -> None:
        """Run under a memory plan, streaming its deep layers through ``weights`` (a `LayerStreamer` or None)."""
        self.weights, self.memory_plan = weights, plan

    def close(self) -> None:
        """Stop streaming (the reader thread); the model cannot run its streamed layers afterwards."""
        if self.weights is not None:
            self.weights.close()

    # ------------------------------------------------------------------ properties
    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the hidden states (float32 for a model on GGUF blocks)."""
        embedding = self.decoder.embed_tokens
        return embedding.compute_dtype if self._gguf else embedding.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.decoder.embed_tokens.blocks.device if self._gguf else self.decoder.embed_tokens.weight.device

    @property
    def on_blocks(self) -> bool:
        """Whether the linears compute on a GGUF file's blocks (`cats.model.kernels.gguf_modules`)."""
        return self._gguf

    @property
    def kernel_attention(self) -> bool:
        """Whether attention over few tokens runs on the row-invariant AVX-512 kernel (packed models and models on
        GGUF blocks: their linears are row-invariant too, so speculative output equals plain output bit for bit)."""
        return self.packed or self._gguf

    @property
    def weight_format(self) -> str:
        """What the weights are, for reports: ``GGUF Q4_K+Q6_K`` (the file's types), or the float dtype."""
        types = sorted({module.type_name for module in self.hf_model.modules() if isinstance(module, GGUFLinear)})
        return f"GGUF {'+'.join(types)}" if types else str(self.dtype).removeprefix("torch.")

    @property
    def kernel_path(self) -> str:
        """What the linears run on, for reports: ``gguf-blocks/amx`` (or ``avx512``, ``avx2``), ``packed/avx512``,
        ``packed/onednn`` or ``aten``."""
        if self._gguf:
            return kernel_path()
        if self.packed:
            return "packed/avx512" if avx512.unavailable(self.dtype) is None else "packed/onednn"
        return "aten"

    @property
    def vocab_size(self) -> int:
        return self.hf_model.lm_head.out_features

    @property
    def context_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 0) or 1 << 30

    @property
    def usable_context(self) -> int:
        """Tokens one generation may hold, prompt and new tokens together: the context window, or under a memory
        budget the KV cache its plan reserved (`MemoryNeeds.context_tokens`), if fewer."""
        if self.memory_plan is None:
            return self.context_length
        return min(self.context_length, self.memory_plan.needs.context_tokens)

    @property
    def eos_token_ids(self) -> set[int]:
        return eos_token_ids(getattr(self.hf_model, "generation_config", None), self.config, self.tokenizer)

    def new_cache(self, extra_layers: int = 0, capacity: int | None = None) -> KVCache:
        """A cache for the target's layers plus ``extra_layers`` slots (indices ``num_layers ..``) that adapters
        use for their own blocks, so that every roll-back of the target rolls them back too. ``capacity``: the
        tokens to preallocate K/V for (the cache grows past it if needed)."""
        return KVCache(self.num_layers + extra_layers, capacity)

    # ------------------------------------------------------------------ forward pieces
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[T]`` or ``[1, T]`` -> hidden states ``[1, T, H]`` (input of layer 0)."""
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        return self.decoder.embed_tokens(input_ids.to(self.device))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head (+ the final logit soft-cap some families use): ``[..., H] -> [..., V]``."""
        logits = self.hf_model.lm_head(self.decoder.norm(hidden))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @property
    def head_streamed(self) -> bool:
        """Whether the lm_head streams under the memory plan (`cats.model.streamed_head`)."""
        return self.memory_plan is not None and self.memory_plan.head_streamed

    def draft_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits a draft reads out (``[..., V]``): the head's, or while the lm_head streams, those of its
        resident draft-vocabulary rows (-inf for every other token)."""
        rows = getattr(self.hf_model, "draft_rows", None)  # set only where the head streams
        if rows is None:
            return self.head(hidden)
        logits = rows(self.decoder.norm(hidden))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def forward_layers(
        self,
        hidden: torch.Tensor,
        start: int,
        end: int,
        cache: KVCache,
        position_ids: torch.Tensor | None = None,
        attend: torch.Tensor | None = None,
        capture: dict[int, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """Run decoder layers ``[start, end)`` on ``hidden`` (``[1, T, H]``, the output of layer ``start - 1``).

        Every layer in the range must hold the same number of cache slots ``P``; the T new tokens are appended
        as slots ``P .. P+T-1`` of each of them.

        Args:
            position_ids: ``[T]`` position of each new token; default ``P + arange(T)`` (a chain).
            attend: optional ``[T, P + T]`` bool matrix, True where new token ``t`` may see slot ``s`` (a tree
                mask). Default: causal in slot order. Sliding-window layers additionally hide slots whose
                position is ``sliding_window`` or more behind the query's.
            capture: keys are layer counts L; for each L in ``(start, end)`` the states after L layers
                (``[T, H]``, a copy) are stored under it.
        Returns:
            hidden states after layer ``end - 1``, ``[1, T, H]``.
        """
        if not 0 <= start <= end <= self.num_layers:
            raise ValueError(f"layer range [{start}, {end}) outside [0, {self.num_layers}]")
        if start == end:
            return hidden
        past = cache.length(start)
        lengths = {cache.length(i) for i in range(start, end)}
        if len(lengths) != 1:
            raise RuntimeError(f"layers [{start}, {end}) hold different cache lengths {sorted(lengths)}")
        num_new = hidden.shape[1]
        if position_ids is None:
            position_ids = torch.arange(past, past + num_new)
        position_ids = position_ids.to(torch.long).cpu()
        kinds = set(self.layer_types[start:end])
        masks = {kind: self.attention_mask(cache.positions(start), position_ids, attend, kind) for kind in kinds}
        device_positions = position_ids.to(self.device).unsqueeze(0)
        rotary = {kind: self.rotary(hidden, device_positions, kind) for kind in kinds}
        weights = self.weights
        fused = {}  # per attention kind: whether the whole-layer kernel runs this forward
        if ((self.packed or self._gguf) and self.lean and not self.exact_attention
                and any(self._fused_layers[start:end])):
            hidden = hidden.clone(memory_format=torch.contiguous_format)  # it works in place: not on the caller's
            fused = {kind: fused_ready(hidden, masks[kind], rotary[kind], self._fused_head_dim) for kind in kinds}
        # every layer on the whole-layer kernel: each run of resident layers between two captured states in one C
        # call (under a budget each streamed layer is acquired around a call of its own)
        together = bool(fused) and all(fused.values()) and all(self._fused_layers[start:end])
        streamed = set() if weights is None else {i for i in range(start, end) if weights.is_streamed(i)}
        stops = sorted({end} | {i for layer in streamed for i in (layer, layer + 1) if start < i < end}
                       | ({count for count in capture if start < count < end} if capture is not None else set()))
        first = start
        for stop in stops:
            if stop == first:
                continue
            if not (together and first not in streamed and fused_layers_forward(
                    list(self.layers)[first:stop], hidden, [masks[kind] for kind in self.layer_types[first:stop]],
                    [rotary[kind] for kind in self.layer_types[first:stop]], cache.hf_cache)):
                hidden = self._layer_by_layer(first, stop, hidden, masks, rotary, fused, device_positions, cache)
            if capture is not None and stop in capture and stop < end:
                capture[stop] = hidden[0].clone()
            first = stop
        cache.record(start, end, position_ids)
        return hidden

    def _layer_by_layer(self, start: int, end: int, hidden: torch.Tensor, masks: dict, rotary: dict, fused: dict,
                        device_positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Layers ``[start, end)`` of `forward_layers` one call each: on the whole-layer kernel where ``fused`` says
        it runs (per attention kind), else `run_layer`; each streamed layer's weights acquired around its call."""
        weights = self.weights
        for i in range(start, end):
            kind = self.layer_types[i]
            if weights is not None:  # a streamed layer's parameters are real only between acquire and release
                weights.acquire(i)
            try:
                if not (fused.get(kind) and self._fused_layers[i] and fused_layer_forward(
                        self.layers[i], hidden, masks[kind], rotary[kind], cache.hf_cache)):
                    hidden = self.run_layer(i, hidden, masks[kind], rotary[kind], device_positions, cache.hf_cache)
            finally:
                if weights is not None:
                    weights.release(i)
        return hidden

    def run_layer(self, i: int, hidden: torch.Tensor, mask: torch.Tensor | None, rotary, position_ids: torch.Tensor,
                  hf_cache) -> torch.Tensor:
        """Decoder layer ``i`` on ``hidden`` (its K/V appended to ``hf_cache``): the lean forward where it has one
        and `lean` is on, else the module's own forward. Callers account for the slots (`KVCache.record`)."""
        layer = self.layers[i]
        if self.lean and self._lean_layers[i]:
            return lean_layer_forward(layer, hidden, mask, rotary, hf_cache, pack_queries=not self.exact_attention,
                                      kernels=self.kernel_attention)
        out = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids,
                    cache=hf_cache, use_cache=True)
        return out[0] if isinstance(out, tuple) else out

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        position_ids: torch.Tensor | None = None,
        attend: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """All layers plus the head: token ids ``[T]`` -> logits ``[T, V]``."""
        hidden = self.forward_layers(self.embed(input_ids), 0, self.num_layers, cache, position_ids, attend)
        return self.head(hidden)[0]

    # ------------------------------------------------------------------ masks and rotary embeddings
    def rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor, kind: str = FULL):
        """The model's own rotary (cos, sin) for ``position_ids`` (``[1, T]`` or ``[B, T]``) and attention kind.
        Families that differ in nothing else share one rotary embedding; Gemma3 has one per kind."""
        if self._rotary_per_layer_type:
            return self.decoder.rotary_emb(hidden, position_ids, kind)
        return self.decoder.rotary_emb(hidden, position_ids)

    def attention_mask(
        self, past_positions: torch.Tensor, query_positions: torch.Tensor, attend: torch.Tensor | None, kind: str
    ) -> torch.Tensor | None:
        """Additive float mask ``[1, 1, T, P+T]`` (0 = attend, finfo.min = hidden) for T new tokens over P cached
        slots with these positions, or None where every slot is visible to a single query (SDPA and eager both
        need no mask then).

        Float, not bool: eager attention adds the mask to the scores, so a bool mask would be silently wrong."""
        num_past, num_new = past_positions.numel(), query_positions.numel()
        if attend is None:
            visible = torch.ones(num_new, num_past + num_new, dtype=torch.bool).tril(num_past)
        else:
            if attend.shape != (num_new, num_past + num_new):
                raise ValueError(f"attend must be [{num_new}, {num_past + num_new}], got {list(attend.shape)}")
            visible = attend.to(torch.bool).cpu()
        if kind == SLIDING and self.sliding_window:
            kv_positions = torch.cat([past_positions, query_positions])
            visible = visible & (query_positions[:, None] - kv_positions[None, :] < self.sliding_window)
        if num_new == 1 and bool(visible.all()):
            return None
        mask = torch.zeros(visible.shape, dtype=self.dtype)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        return mask[None, None].to(self.device)
