"""Draft and shallow adapters: one decoder block of the target's own architecture (attention + MLP, or attention
only as in Kangaroo) plus a norm, fed the target's hidden state after layer L and read out through the target's
own lm_head (shared with the target, never stored in the adapter; with a reduced vocabulary only those rows).

A *feature* draft adapter (``input="features"``, EAGLE-style) reads the target's last features instead: at position
t its input is ``fc([f_t, e(x_{t+1})])``, the target's final normed state f_t (what its lm_head reads) next to the
embedding of the token that follows, and its output (normed) is its estimate of f_{t+1}, read out through the
lm_head. Its ``layer`` is the number of target layers (it runs after all of them); see `cats.draft.eagle`.

An *early-exit feature* adapter (``input="features+hidden"``) reads ``fc([f_t, h_L(x_{t+1})])``: the next token's
state after the target's first L layers instead of its embedding (the token seen in context), for early exit at
layer L with the target's final features of the committed tokens; see `cats.draft.early_exit`.

On disk an adapter is an HF-style folder: ``config.json`` (see `AdapterConfig`) + ``model.safetensors`` (the
block and norm weights only). It records the identity of the base model it was trained on; loading it onto
another model or asking it for another layer is an error naming both.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from cats.errors import CatsError
from cats.model.cache import KVCache
from cats.model.files import check_safetensors, first_line
from cats.model.draft_vocabulary import DraftVocabulary
from cats.model.identity import model_identity
from cats.model.kernels.layer_forward import (
    fused_layer_forward,
    fused_ready,
    fused_unsupported,
    lean_layer_forward,
    lean_unsupported,
)
from cats.model.kernels.gguf_modules import dequantize_linears, stored_linears
from cats.model.kernels.packing import pack_module
from cats.model.layered import LayeredModel

FORMAT = "cats-adapter/1"
ROLES = ("draft", "shallow")
BLOCKS = ("decoder", "attention")
INITS = ("next", "copy", "random")
INPUTS = ("hidden", "features", "features+hidden")  # the state after layer L; the target's final features + the
# next token's embedding; the final features + the next token's state after layer L


# a feature adapter's fc starts as f_t + FC_TOKEN_SHARE * s * token (s equalises their scales): the token's share
# starts small, because read out through an untied lm_head (Qwen2.5) an equal share makes the first logits large and
# wrong (soft cross-entropy 76 at initialisation on Qwen2.5-Coder-1.5B against 31 at 0.2; held-out agreement after
# 250 steps 0.062 against 0.091)
FC_TOKEN_SHARE = 0.2


class AdapterError(CatsError):
    """A missing, malformed or mismatched adapter."""


REPAIR = "train it again with `cats train adapter` or restore the folder from its source"


@dataclass
class AdapterConfig:
    role: str  # "draft" (proposes tokens) or "shallow" (the cascade's shallow verifier)
    layer: int  # fed the hidden state after `layer` decoder layers (the input of 0-based layer `layer`)
    architecture: str  # the base model's model_type
    base_model: dict  # model_identity() of the base model: name, model_type, num_layers, fingerprint
    block: str = "decoder"  # "decoder" (attention + MLP) or "attention" (attention only)
    init: str = "next"  # how the block was initialised: next = target layer `layer`, copy = last layer, random
    vocab_subset: list[int] | None = None  # token ids of a reduced draft vocabulary (most frequent first); None = all
    training: dict = field(default_factory=dict)  # data, settings, metrics, learning curve
    input: str = "hidden"  # "hidden" (state after `layer`), "features" (EAGLE-style: final features + next token's
    # embedding) or "features+hidden" (final features + next token's state after `layer`)
    format: str = FORMAT

    def validate(self) -> None:
        if self.format != FORMAT:
            raise AdapterError(f"adapter format {self.format!r} is not {FORMAT!r}")
        if self.role not in ROLES:
            raise AdapterError(f"adapter role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.block not in BLOCKS:
            raise AdapterError(f"adapter block must be one of {', '.join(BLOCKS)}, got {self.block!r}")
        if self.init not in INITS:
            raise AdapterError(f"adapter init must be one of {', '.join(INITS)}, got {self.init!r}")
        if self.input not in INPUTS:
            raise AdapterError(f"adapter input must be one of {', '.join(INPUTS)}, got {self.input!r}")
        if self.input != "hidden" and self.role != "draft":
            raise AdapterError(f"a feature adapter (input {self.input!r}) drafts: its role must be 'draft'")

    @property
    def reads_features(self) -> bool:
        """Whether the adapter reads the target's final features (``fc`` input), not only a layer's state."""
        return self.input != "hidden"


class _NoMLP(nn.Module):
    """The MLP of an attention-only block: adds nothing to the residual stream."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden)


def _copy(module: nn.Module, meta_parameters: bool) -> nn.Module:
    """A deep copy of ``module``; with ``meta_parameters`` its parameters are empty meta tensors of the same shapes
    and dtypes (their values to be assigned from a file), so nothing is copied but the structure."""
    if not meta_parameters:
        return copy.deepcopy(module)
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad) for p in module.parameters()}
    return copy.deepcopy(module, memo)


class Adapter(DraftVocabulary, nn.Module):
    """The adapter module. Its only parameters are the block's and the norm's; the target (rotary embedding,
    lm_head, masks) is referenced, not registered, so ``adapter.parameters()`` is exactly what training updates.

    ``cache_layer`` is the index of the adapter's own K/V in a `KVCache` made by
    ``model.new_cache(extra_layers=...)``: cropping the target's cache crops the adapter's in the same step."""

    def __init__(self, config: AdapterConfig, model: LayeredModel, cache_layer: int | None = None,
                 from_file: bool = False):
        super().__init__()
        config.validate()
        features = config.reads_features
        if config.input == "features" and config.layer != model.num_layers:
            raise AdapterError(f"a feature adapter reads the features after all {model.num_layers} layers of "
                               f"{model.name!r}, but its config says layer {config.layer}")
        if config.input != "features" and not 1 <= config.layer < model.num_layers:
            raise AdapterError(f"adapter layer {config.layer} is outside [1, {model.num_layers}) for {model.name!r}")
        self.config = config
        self.__dict__["target"] = model  # not a submodule
        self._cache_layer = model.num_layers if cache_layer is None else cache_layer
        last = model.num_layers - 1
        source = model.layers[last] if config.init == "copy" or features else model.layers[config.layer]
        # float, trainable, whatever the target runs on; ``from_file``: its parameters are made on the meta device, to
        # be assigned from a file (no float copy of a resident target layer is made first)
        self.block = dequantize_linears(_copy(source, from_file))
        if config.init == "random":
            self.block.apply(model.hf_model._init_weights)
        self.cache_layer = self.cache_layer  # its K/V go to the adapter's own cache layer (see the property)
        if config.block == "attention":
            self.block.mlp = _NoMLP()
        self.norm = _copy(model.decoder.norm, from_file)
        # attention kind (and rotary) of the layer it replaces (a feature adapter: of the last layer)
        self.kind = model.layer_types[last if features else config.layer]
        self.fc = None  # feature adapters: [f_t, e(x_{t+1}) or h_L(x_{t+1})] (2H) -> H, see _init_fc
        if features:
            size = model.config.hidden_size
            self.fc = nn.Linear(2 * size, size, bias=True, dtype=self.norm.weight.dtype,  # new_adapter initialises it
                                device="meta" if from_file else None)
        self.block.requires_grad_(True)
        self.norm.requires_grad_(True)
        subset = config.vocab_subset
        self.register_buffer("vocab_ids", torch.tensor(subset, dtype=torch.long) if subset else None, persistent=False)
        self._head_rows: torch.Tensor | None = None
        self._train_rows: torch.Tensor | None = None
        self._packed = False
        self._lean: bool | None = None  # whether the block has a lean forward (`_lean_block`)
        self._fused: bool | None = None  # whether it can run the whole-layer kernel (`_fused_block`)

    @torch.no_grad()
    def _init_fc(self, model: LayeredModel) -> None:
        """``fc`` starts as ``f_t + FC_TOKEN_SHARE * s * e(x_{t+1})`` (or ``... * h_L(x_{t+1})``), s = rms(normed
        state) / rms(token input): the final norm's output scale and the embeddings' often differ a lot (SmolLM2:
        1.9 vs 0.14; Qwen2.5-Coder-1.5B: 4.6 vs 0.017), and an unscaled sum would drown the token out."""
        size = model.config.hidden_size
        probe = torch.randn(64, size, generator=torch.Generator().manual_seed(0)).to(model.decoder.norm.weight)
        normed = model.decoder.norm(probe).float().pow(2).mean().sqrt()
        tokens = torch.arange(min(model.vocab_size, 4096 if self.config.input == "features" else 64))
        token_inputs = model.embed(tokens)
        if self.config.input == "features+hidden":  # the probe tokens' states after layer L (a throwaway cache)
            token_inputs = model.forward_layers(token_inputs, 0, self.config.layer, model.new_cache())
        token_rms = token_inputs[0].float().pow(2).mean().sqrt()
        scale = float(normed / token_rms.clamp(min=1e-12)) * FC_TOKEN_SHARE
        eye = torch.eye(size, dtype=self.fc.weight.dtype)
        self.fc.weight.copy_(torch.cat([eye, scale * eye], dim=1))
        self.fc.bias.zero_()
        self._init_uniform_norm(float(normed))
        # the copied last layer writes into a residual stream of the target's scale; ours starts as f_t (rms of the
        # normed features): shrink its writes where the target's stream is larger (Qwen2.5-Coder-1.5B: 4.85 against
        # 4.66 on this probe, a shrink of 0.96 that changed its starting loss by nothing measurable)
        stream = model.forward_layers(model.embed(tokens[:64]), 0, model.num_layers, model.new_cache())
        shrink = float(normed / stream.float().pow(2).mean().sqrt().clamp(min=1e-12))
        if shrink < 1:
            for linear in (self.block.self_attn.o_proj, getattr(self.block.mlp, "down_proj", None)):
                if linear is not None:
                    linear.weight.mul_(shrink)
                    if linear.bias is not None:
                        linear.bias.mul_(shrink)

    @torch.no_grad()
    def _init_uniform_norm(self, scale: float) -> None:
        """A feature adapter's residual starts as f_t, which already carries the final norm's weight; reading it out
        through that weight again would apply it twice (Qwen2.5-Coder-1.5B's reaches 11.8: the first logits are
        large and training starts far off). So its norm starts as one uniform ``scale`` (the rms of the final
        norm's output): the output starts near f_t. Found whatever the norm's form (``w`` or Gemma's ``1 + w``)."""
        weight = self.norm.weight
        unit = torch.ones(1, weight.shape[-1], dtype=weight.dtype)
        weight.zero_()
        at_zero = float(self.norm(unit).float().mean())
        weight.fill_(1.0)
        at_one = float(self.norm(unit).float().mean())
        weight.fill_((scale - at_zero) / (at_one - at_zero))

    def _lean_block(self) -> bool:
        """Whether the block can run the target's lean layer forward (decoding, a block class that has one)."""
        if self._lean is None:
            self._lean = lean_unsupported(self.block) is None
        return self._lean

    def _fused_block(self) -> bool:
        """Whether the block can run the whole-layer kernel once packed (`cats.model.kernels.layer_forward.fused_unsupported`)."""
        if self._fused is None:
            self._fused = fused_unsupported(self.block) is None
        return self._fused

    def _fused_forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, rotary, cache: KVCache):
        """The block on ``hidden`` through the whole-layer kernel (on a copy: it works in place), appending to
        ``cache``; None where it does not run (the caller then takes the lean forward)."""
        model = self.target
        if not ((self._packed or model.on_blocks) and model.lean and not model.exact_attention and not self.training and self._fused_block()
                and fused_ready(hidden, attention_mask, rotary, self.block.self_attn.head_dim)):
            return None
        out = hidden.clone(memory_format=torch.contiguous_format)
        return out if fused_layer_forward(self.block, out, attention_mask, rotary, cache.hf_cache) else None

    @property
    def cache_layer(self) -> int:
        """Index of the adapter's own layer in the `KVCache` (the target's layers come first)."""
        return self._cache_layer

    @cache_layer.setter
    def cache_layer(self, index: int) -> None:
        self._cache_layer = index
        self.block.self_attn.layer_idx = index  # HF attention writes its K/V to cache layer `layer_idx`

    # ------------------------------------------------------------------ forward
    def forward(self, hidden: torch.Tensor, cache: KVCache | None = None, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, attend: torch.Tensor | None = None) -> torch.Tensor:
        """Block + norm on target states after layer L: ``[B, T, H] -> [B, T, H]`` (a feature adapter takes
        ``[B, T, 2H]``: ``[f_t, e(x_{t+1})]`` per position, see `feature_inputs`).

        With a cache (decoding, B = 1) the T states are appended to the adapter's cache layer and attend to all
        earlier slots (or, for tree nodes, to those ``attend`` ``[T, P+T]`` allows, as in
        `LayeredModel.forward_layers`). Without (training), ``attention_mask`` is a ready additive mask
        ``[B, 1, T, T]``."""
        model = self.target
        if model.packed and not self.training and not self._packed:  # the target packs its linears: so do we

            self._packed = pack_module(self.block) > 0
            if self.fc is not None:  # a feature adapter's input projection runs every draft step too
                pack_module(self.fc)
        if self.fc is not None:
            hidden = self.fc(hidden)
        if cache is not None:
            past = cache.length(self.cache_layer)
            if position_ids is None:
                position_ids = torch.arange(past, past + hidden.shape[1])
            attention_mask = model.attention_mask(cache.positions(self.cache_layer), position_ids, attend, self.kind)
            positions = position_ids.to(hidden.device).unsqueeze(0)
        else:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0).expand(hidden.shape[0], -1)
        rotary = model.rotary(hidden, positions, self.kind)
        out = self._fused_forward(hidden, attention_mask, rotary, cache) if cache is not None else None
        if out is None and cache is not None and model.lean and not self.training and self._lean_block():
            out = lean_layer_forward(self.block, hidden, attention_mask, rotary, cache.hf_cache,
                                     pack_queries=not model.exact_attention, kernels=model.kernel_attention)
        elif out is None:
            out = self.block(hidden, attention_mask=attention_mask, position_embeddings=rotary, position_ids=positions,
                             cache=cache.hf_cache if cache is not None else None, use_cache=cache is not None)
            out = out[0] if isinstance(out, tuple) else out
        if cache is not None:
            cache.record(self.cache_layer, self.cache_layer + 1, position_ids.cpu())
        return self.norm(out)

    def feature_inputs(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """A feature adapter's input ``[..., T, 2H]`` from the target's final normed features ``[..., T, H]`` at
        positions t and the tokens x_{t+1} that follow them: their ids ``[..., T]`` (input "features", embedded
        here) or their states after layer L ``[..., T, H]`` (input "features+hidden")."""
        if next_tokens.is_floating_point():
            if self.config.input != "features+hidden":
                raise ValueError(f"a {self.config.input!r} adapter reads token ids, not states")
            return torch.cat([features, next_tokens.to(features.dtype)], dim=-1)
        if self.config.input != "features":
            raise ValueError("a 'features+hidden' adapter reads the next tokens' states after its layer, not ids")
        embedded = self.target.hf_model.get_input_embeddings()(next_tokens.to(features.device))
        return torch.cat([features, embedded.to(features.dtype)], dim=-1)

    # ------------------------------------------------------------------ files
    def save(self, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
        """Write the folder; ``dtype`` stores the float tensors in another dtype (e.g. bfloat16, half the bytes;
        loading converts them to the model's dtype)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {name: (tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor)
                 .detach().contiguous().cpu() for name, tensor in self.state_dict().items()}
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        return folder


def new_adapter(model: LayeredModel, role: str, layer: int, block: str = "decoder", init: str = "next",
                vocab_subset: list[int] | None = None, cache_layer: int | None = None, input: str = "hidden") -> Adapter:
    """A fresh adapter for ``model`` (before training)."""
    if init not in INITS:
        raise AdapterError(f"adapter init must be one of {', '.join(INITS)}, got {init!r}")
    config = AdapterConfig(role=role, layer=layer, architecture=model.config.model_type, base_model=model_identity(model),
                           block=block, init=init, vocab_subset=vocab_subset, input=input)
    adapter = Adapter(config, model, cache_layer)
    if adapter.fc is not None:
        adapter._init_fc(model)
    return adapter.to(model.dtype)


def load_adapter(folder: str | Path, model: LayeredModel, role: str | None = None, layer: int | None = None,
                 cache_layer: int | None = None, on_blocks: bool | None = None) -> Adapter:
    """Load an adapter folder onto ``model``; refuse one trained for another model, role or layer. ``on_blocks``:
    whether its linears compute on the kernels as the file stores them (`stored_linears`); None: where the model
    computes on GGUF blocks; False: float linears in the model's dtype."""
    folder = Path(folder)
    config = read_adapter_config(folder)
    weights_file = folder / "model.safetensors"
    base, here = config.base_model, model_identity(model)
    if base.get("fingerprint") != here["fingerprint"]:
        raise AdapterError(
            f"adapter {str(folder)!r} was trained for model {base.get('name')!r} (fingerprint {base.get('fingerprint')}), "
            f"not for {here['name']!r} (fingerprint {here['fingerprint']})"
        )
    if role is not None and config.role != role:
        raise AdapterError(f"adapter {str(folder)!r} is a {config.role} adapter, not a {role} adapter")
    if layer is not None and config.layer != layer:
        raise AdapterError(f"adapter {str(folder)!r} was trained at layer {config.layer}, not at layer {layer}")
    if config.vocab_subset is not None and not all(0 <= i < model.vocab_size for i in config.vocab_subset):
        raise AdapterError(f"{folder / 'config.json'}: its vocab_subset holds token ids outside [0, {model.vocab_size}) "
                           f"of {model.name!r}; {REPAIR}")
    adapter = Adapter(config, model, cache_layer, from_file=True)
    try:
        state = load_file(str(weights_file))
        # assign: the block was copied from a target layer, which streams (meta parameters) under a memory budget
        missing, unexpected = adapter.load_state_dict(state, strict=False, assign=True)
    except (SafetensorError, RuntimeError, OSError, ValueError) as error:  # e.g. a tensor of another shape
        raise AdapterError(f"{weights_file} does not fit the adapter's block ({first_line(error)}); {REPAIR}") from None
    if missing or unexpected:
        raise AdapterError(f"{weights_file} does not match the adapter's block: missing tensor(s) {missing}, "
                           f"unexpected {unexpected}; {REPAIR}")
    if model.on_blocks if on_blocks is None else on_blocks:  # bfloat16 linears: half the bytes of float32 copies
        stored_linears(adapter)
    return adapter.to(model.dtype).eval().requires_grad_(False)


def read_adapter_config(folder: Path) -> AdapterConfig:
    """The checked config of an adapter folder, its ``model.safetensors`` checked as a file (`check_safetensors`):
    a missing, damaged or truncated file is an `AdapterError` or a `DamagedFileError` naming it."""
    config_file, weights_file = folder / "config.json", folder / "model.safetensors"
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise AdapterError(f"adapter folder {str(folder)!r} lacks {needed.name}; train one with `cats train adapter`")
    try:
        data = json.loads(config_file.read_bytes())
        config = AdapterConfig(**data)
        config.layer = _whole(config.layer, "layer")
        if config.vocab_subset is not None:
            config.vocab_subset = [_whole(i, "vocab_subset") for i in config.vocab_subset]
        if not isinstance(config.base_model, dict):
            raise TypeError(f"base_model is {type(config.base_model).__name__}, not an object")
    except (TypeError, ValueError, OSError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise AdapterError(f"{config_file} is not a CATS adapter config ({first_line(error)}); {REPAIR}") from None
    config.validate()
    check_safetensors(weights_file, REPAIR)
    return config


def _whole(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} holds {value!r}, not a whole number")
    return value


def find_draft_adapter(folder: str | Path, early_exit: bool = False) -> Path:
    """The draft adapter of an adapters folder (``DIR/draft/``, or DIR itself); for early exit its own
    ``DIR/early-exit/`` (an early-exit feature adapter, input ``features+hidden``) when there is one."""
    own = Path(folder) / "early-exit"
    if early_exit and (own / "config.json").is_file():
        return own
    return find_adapter(folder, "draft")


def find_adapter(folder: str | Path, role: str) -> Path:
    """``DIR/<role>/`` when ``DIR`` holds per-role adapters (as ``adapters/<model>/``), else ``DIR`` itself."""
    folder = Path(folder)
    if (folder / role / "config.json").is_file():
        return folder / role
    if (folder / "config.json").is_file():
        return folder
    raise AdapterError(f"no {role} adapter in {str(folder)!r} (expected {folder / role / 'config.json'})")
