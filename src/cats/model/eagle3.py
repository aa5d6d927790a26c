"""The EAGLE-3 draft head, in the layout the serving engines load (vLLM, SGLang, llama.cpp; see `cats.export`).

It reads the target's hidden states after three of its layers (low, middle, high; ``aux_layers``, each the number
of target layers run, i.e. the input of that 0-based layer) and fuses them: ``g_t = fc([h_a, h_b, h_c])`` (3H -> H).
One decoder layer (``midlayer``) follows, whose attention reads ``[input_layernorm(e(x_{t+1})), hidden_norm(g_t)]``
(2H) and whose residual stream starts at g_t; then an MLP, a final ``norm`` and the read-out. Position t of its
cache holds ``[g_t, e(x_{t+1})]`` and its output estimates the state that drafts x_{t+2}. A draft node deeper in
the tree feeds its parent's output (before the final norm) as its g: the same contract as the engines' (the
"pre-norm" state llama.cpp keeps in ``t_h_nextn`` and vLLM returns as ``hidden_prenorm``).

Read-out: the target's lm_head rows of a reduced draft vocabulary (`DraftVocabulary`), as the feature adapter's:
the head stores no head. An export writes those rows as the engines' ``lm_head`` with the ``d2t`` map.

The attention is Llama's (no biases, rotary ``rope_theta`` in the half-split layout), whatever the target's family,
because that is the layer every engine builds. Its head count and MLP width are free (``--heads``,
``--intermediate-size``), so the head can be made as small as a feature adapter.

On disk: an HF-style folder, ``config.json`` (`Eagle3Config`) and ``model.safetensors`` with the tensor names of
the EAGLE-3 checkpoints (``fc.weight``, ``midlayer.*``, ``norm.weight``).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from cats.errors import CatsError
from cats.model.cache import KVCache
from cats.model.decoder import DecoderMLP, DecoderRMSNorm, DecoderRotaryEmbedding, apply_rotary
from cats.model.draft_vocabulary import DraftVocabulary
from cats.model.files import check_safetensors, first_line
from cats.model.identity import model_identity
from cats.model.kernels.gguf_modules import stored_linears
from cats.model.layered import LayeredModel

FORMAT = "cats-eagle3/1"
REPAIR = "train it again with `cats train adapter --arch eagle3` or restore the folder from its source"
KIND = "full_attention"  # the head attends to every earlier entry


class Eagle3Error(CatsError):
    """A missing, malformed or mismatched EAGLE-3 head."""


@dataclass
class Eagle3Config:
    aux_layers: list[int]  # the target's states after these many layers (low, middle, high) feed fc
    hidden_size: int  # the target's (the head shares its embeddings and lm_head rows)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's whole vocabulary
    architecture: str  # the target's model_type
    base_model: dict  # model_identity() of the target it was trained on
    vocab_subset: list[int] | None = None  # token ids of the draft vocabulary (most frequent first); None = all
    training: dict = field(default_factory=dict)
    format: str = FORMAT

    def validate(self, num_layers: int | None = None) -> None:
        if self.format != FORMAT:
            raise Eagle3Error(f"EAGLE-3 head format {self.format!r} is not {FORMAT!r}")
        if len(self.aux_layers) != 3 or sorted(set(self.aux_layers)) != list(self.aux_layers):
            raise Eagle3Error(f"an EAGLE-3 head reads three increasing target layers, got {self.aux_layers}")
        top = num_layers if num_layers is not None else max(self.aux_layers) + 1
        if not all(1 <= layer < top for layer in self.aux_layers):
            raise Eagle3Error(f"EAGLE-3 aux layers {self.aux_layers} must lie in [1, {top})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise Eagle3Error(f"{self.num_attention_heads} attention heads do not share {self.num_key_value_heads} "
                              "key/value heads evenly")
        if min(self.num_attention_heads, self.num_key_value_heads, self.head_dim, self.intermediate_size) < 1:
            raise Eagle3Error("heads, head_dim and intermediate_size must be positive")

    def llama_config(self) -> SimpleNamespace:
        """The draft layer's settings as a one-layer Llama's config gives them (what the engines build; read by its
        MLP and rotary embedding here, `cats.model.decoder`)."""
        return SimpleNamespace(model_type="llama", hidden_size=self.hidden_size,
                               intermediate_size=self.intermediate_size, num_attention_heads=self.num_attention_heads,
                               num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                               rms_norm_eps=self.rms_norm_eps, hidden_act="silu", attention_bias=False, mlp_bias=False,
                               rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta})


class _Attention(nn.Module):
    """Llama attention whose projections read 2H (the normed embedding next to the normed fused state)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        size, heads, kv_heads, dim = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim
        self.q_proj = nn.Linear(2 * size, heads * dim, bias=False)
        self.k_proj = nn.Linear(2 * size, kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(2 * size, kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, size, bias=False)

    def forward(self, x: torch.Tensor, rotary, mask: torch.Tensor | None, cache: KVCache | None, layer: int,
                earlier: tuple[torch.Tensor, torch.Tensor] | None = None):
        """``earlier``: keys and values ``[B, kv_heads, S, head_dim]`` placed before these tokens' (training-time
        test: the first step's entries); ``self.last_kv`` keeps this call's own."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, k, *rotary)
        self.last_kv = (k, v)
        if cache is not None:
            k, v = cache.hf_cache.update(k, v, layer)
        if earlier is not None:
            k, v = torch.cat([earlier[0], k], dim=2), torch.cat([earlier[1], v], dim=2)
        groups = self.heads // self.kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))


class _MidLayer(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        llama = config.llama_config()
        self.input_layernorm = DecoderRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = DecoderRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = DecoderRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = DecoderMLP(llama)


class Eagle3Head(DraftVocabulary, nn.Module):
    """The head; its parameters are exactly what training updates (the target is referenced, not registered).

    ``cache_layer`` is the index of its K/V in a `KVCache` made by ``model.new_cache(extra_layers=1)``, so that
    cropping the target's cache crops the head's in the same step."""

    def __init__(self, config: Eagle3Config, model: LayeredModel, cache_layer: int | None = None,
                 from_file: bool = False):
        super().__init__()
        config.validate(model.num_layers)
        if config.hidden_size != model.config.hidden_size or config.vocab_size != model.vocab_size:
            raise Eagle3Error(f"the EAGLE-3 head is for hidden size {config.hidden_size} and vocabulary "
                              f"{config.vocab_size}; {model.name!r} has {model.config.hidden_size} and {model.vocab_size}")
        self.config = config
        self.__dict__["target"] = model  # not a submodule
        self.cache_layer = model.num_layers if cache_layer is None else cache_layer
        self.kind = KIND
        size = config.hidden_size
        # ``from_file``: the parameters are made on the meta device, to be assigned from a file (no float copy first)
        with torch.device("meta") if from_file else contextlib.nullcontext():
            self.fc = nn.Linear(3 * size, size, bias=False)
            self.midlayer = _MidLayer(config)
            self.norm = DecoderRMSNorm(size, eps=config.rms_norm_eps)
        self.__dict__["rotary"] = DecoderRotaryEmbedding(config.llama_config())  # no parameters: not in the state
        subset = config.vocab_subset
        self.register_buffer("vocab_ids", torch.tensor(subset, dtype=torch.long) if subset else None, persistent=False)
        self._head_rows: torch.Tensor | None = None
        self._train_rows: torch.Tensor | None = None

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose states the head reads (the loop hands it those of every committed token)."""
        return tuple(self.config.aux_layers)

    def features(self, states: dict[int, torch.Tensor]) -> torch.Tensor:
        """The fused state g ``[..., H]`` of positions whose target states after each aux layer are ``states``."""
        aux = torch.cat([states[layer].to(self.norm.weight.dtype) for layer in self.config.aux_layers], dim=-1)
        return self.fc(aux)

    def feature_inputs(self, g: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """The head's input ``[..., T, 2H]``: fused (or parent output) states g next to the embeddings of the tokens
        that follow them (ids ``[..., T]``)."""
        embedded = self.target.hf_model.get_input_embeddings()(next_tokens.to(g.device))
        return torch.cat([g, embedded.to(g.dtype)], dim=-1)

    def forward(self, inputs: torch.Tensor, cache: KVCache | None = None, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, attend: torch.Tensor | None = None,
                unroll: bool = False):
        """``[B, T, 2H]`` (`feature_inputs`) -> the states before the final norm ``[B, T, H]`` (the next node's g;
        `logits` reads them). Training passes ``[B, T, 4H]`` instead: the three aux states and the embedding, so
        that ``fc`` runs inside the forward; ``unroll=True`` then returns both steps of `unrolled`.

        With a cache (decoding, B = 1) the T entries are appended to the head's cache layer and attend to all
        earlier slots, or for tree nodes to those ``attend`` ``[T, P+T]`` allows. Without (training),
        ``attention_mask`` is a ready additive mask ``[B, 1, T, T]``."""
        model, size = self.target, self.config.hidden_size
        if unroll:
            return self.unrolled(inputs, attention_mask)
        if inputs.shape[-1] == 4 * size:  # three aux states + the embedding
            g, embedded = self.fc(inputs[..., : 3 * size]), inputs[..., 3 * size :]
        else:
            g, embedded = inputs[..., :size], inputs[..., size:]
        if cache is not None:
            past = cache.length(self.cache_layer)
            if position_ids is None:
                position_ids = torch.arange(past, past + inputs.shape[1])
            attention_mask = model.attention_mask(cache.positions(self.cache_layer), position_ids, attend, KIND)
            positions = position_ids.to(inputs.device).unsqueeze(0)
        else:
            positions = torch.arange(inputs.shape[1], device=inputs.device).unsqueeze(0).expand(inputs.shape[0], -1)
        hidden = self._layer(g, embedded, positions, attention_mask, cache)
        if cache is not None:
            cache.record(self.cache_layer, self.cache_layer + 1, position_ids.cpu())
        return hidden

    def _layer(self, g, embedded, positions, mask, cache=None, earlier=None) -> torch.Tensor:
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(embedded), layer.hidden_norm(g)], dim=-1)
        if mask is not None:
            mask = mask.to(x.dtype)
        hidden = g + layer.self_attn(x, self.rotary(x, positions), mask, cache, self.cache_layer, earlier)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def unrolled(self, inputs: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training-time test (EAGLE-3): the forward on ``[B, T, 4H]`` (as in training), then a second step as drafting
        runs it: at t < T-1 the input is ``[this step's output at t, e(x_{t+2})]`` at position t + 1, attending to
        the first step's entries up to t and to itself. Returns both steps' outputs before the final norm:
        ``[B, T, H]`` (predicting the teacher at t) and ``[B, T-1, H]`` (predicting the teacher at t + 1)."""
        size = self.config.hidden_size
        batch, length = inputs.shape[:2]
        g, embedded = self.fc(inputs[..., : 3 * size]), inputs[..., 3 * size :]
        positions = torch.arange(length, device=inputs.device).unsqueeze(0).expand(batch, -1)
        first = self._layer(g, embedded, positions, attention_mask)
        earlier = self.midlayer.self_attn.last_kv
        own = torch.full((length - 1, length - 1), torch.finfo(attention_mask.dtype).min, dtype=attention_mask.dtype)
        own.fill_diagonal_(0)
        mask = torch.cat([attention_mask[:, :, :-1, :], own.expand(batch, 1, -1, -1)], dim=-1)
        second = self._layer(first[:, :-1], embedded[:, 1:], positions[:, 1:], mask, earlier=earlier)
        return first, second

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary of output states ``[..., H]`` (final norm, then the read-out)."""
        return super().logits(self.norm(prenorm))

    def save(self, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
        """Write the folder; ``dtype`` stores the weights in another dtype (bfloat16: half the bytes)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {name: (t.to(dtype) if dtype is not None else t).detach().contiguous().cpu()
                 for name, t in self.state_dict().items()}
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        return folder

    @property
    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())


def new_eagle3_head(model: LayeredModel, aux_layers: list[int] | None = None, heads: int | None = None,
                    kv_heads: int | None = None, intermediate_size: int | None = None,
                    vocab_subset: list[int] | None = None) -> Eagle3Head:
    """A fresh head for ``model``: the engines' default layers (2, n/2, n-3) unless given; the target's head count
    and MLP width unless given.

    Initialised so that it starts as a read-out of the highest aux layer: ``fc`` selects that state, the layer's
    output projections are zero (its residual stream passes g through), the final norm is the target's."""
    config = model.config
    n = model.num_layers
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    head = Eagle3Head(Eagle3Config(
        aux_layers=list(aux_layers or default_aux_layers(n)), hidden_size=config.hidden_size,
        num_attention_heads=heads or config.num_attention_heads,
        num_key_value_heads=kv_heads or min(config.num_key_value_heads, heads or config.num_attention_heads),
        head_dim=dim, intermediate_size=intermediate_size or config.intermediate_size,
        rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)), rope_theta=float(rope_theta(config)),
        vocab_size=model.vocab_size, architecture=config.model_type, base_model=model_identity(model),
        vocab_subset=vocab_subset), model)
    size = config.hidden_size
    with torch.no_grad():
        for module in head.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * size:] = torch.eye(size)
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
        final = model.decoder.norm.weight.detach().float()
        head.norm.weight.copy_(final if not _offset_norm(model) else 1 + final)
    return head.to(model.dtype)


def default_aux_layers(num_layers: int) -> list[int]:
    """The layers vLLM, SGLang and llama.cpp pick when a head names none: 2, n // 2 and n - 3."""
    return [2, num_layers // 2, num_layers - 3]


def rope_theta(config) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    if isinstance(parameters, dict) and "full_attention" in parameters:
        parameters = parameters["full_attention"]
    return parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0))


def _offset_norm(model: LayeredModel) -> bool:
    """Gemma's RMSNorm scales by ``1 + w``: its weight must be offset to act like Llama's ``w``."""
    return model.config.model_type.startswith("gemma")


def load_eagle3_head(folder: str | Path, model: LayeredModel, cache_layer: int | None = None,
                     on_blocks: bool | None = None) -> Eagle3Head:
    """Load a head folder onto ``model``; refuse one trained for another model. ``on_blocks``: whether its linears
    compute on the kernels as the file stores them (`stored_linears`); None: where the model computes on GGUF blocks;
    False: float linears in the model's dtype (export reads their weights)."""
    folder = Path(folder)
    config = read_eagle3_config(folder)
    base, here = config.base_model, model_identity(model)
    if base.get("fingerprint") != here["fingerprint"]:
        raise Eagle3Error(f"EAGLE-3 head {str(folder)!r} was trained for model {base.get('name')!r} (fingerprint "
                          f"{base.get('fingerprint')}), not for {here['name']!r} (fingerprint {here['fingerprint']})")
    if config.vocab_subset is not None and not all(0 <= i < model.vocab_size for i in config.vocab_subset):
        raise Eagle3Error(f"{folder / 'config.json'}: its vocab_subset holds token ids outside [0, {model.vocab_size}); "
                          f"{REPAIR}")
    head = Eagle3Head(config, model, cache_layer, from_file=True)
    weights = folder / "model.safetensors"
    try:
        missing, unexpected = head.load_state_dict(load_file(str(weights)), strict=False, assign=True)
    except (SafetensorError, RuntimeError, OSError, ValueError) as error:
        raise Eagle3Error(f"{weights} does not fit the head ({first_line(error)}); {REPAIR}") from None
    if missing or unexpected:
        raise Eagle3Error(f"{weights} does not match the head: missing {missing}, unexpected {unexpected}; {REPAIR}")
    if model.on_blocks if on_blocks is None else on_blocks:  # bfloat16 linears: half the bytes of float32 copies
        stored_linears(head)
    return head.to(model.dtype).eval().requires_grad_(False)


def read_eagle3_config(folder: Path) -> Eagle3Config:
    """The checked config of a head folder, its ``model.safetensors`` checked as a file."""
    config_file, weights_file = folder / "config.json", folder / "model.safetensors"
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise Eagle3Error(f"EAGLE-3 head folder {str(folder)!r} lacks {needed.name}; train one with "
                              "`cats train adapter --arch eagle3`")
    try:
        config = Eagle3Config(**json.loads(config_file.read_bytes()))
        if not isinstance(config.base_model, dict) or not all(isinstance(i, int) for i in config.aux_layers):
            raise TypeError("base_model must be an object and aux_layers whole numbers")
    except (TypeError, ValueError, OSError) as error:
        raise Eagle3Error(f"{config_file} is not a CATS EAGLE-3 config ({first_line(error)}); {REPAIR}") from None
    config.validate()
    check_safetensors(weights_file, REPAIR)
    return config


def is_eagle3_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds an EAGLE-3 head (by its config's format)."""
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def find_eagle3_folder(adapters: str | Path | None) -> Path | None:
    """The EAGLE-3 head of an adapters folder (``DIR/eagle3/``, or DIR itself when it is one), else None."""
    if adapters is None:
        return None
    return next((folder for folder in (Path(adapters) / "eagle3", Path(adapters)) if is_eagle3_folder(folder)), None)
