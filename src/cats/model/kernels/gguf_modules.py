"""The modules a GGUF model runs on: its linears and its embedding, holding a tensor's rows exactly as the file stores
them (a uint8 view of the memory-mapped file, or rows of it) and computing on them with `cats.model.kernels.quantized`.

They replace transformers' ``nn.Linear`` and ``nn.Embedding`` in the model transformers builds from the GGUF's config
(`cats.model.gguf_model`); every other module (norms, rotary embedding, attention) stays transformers' own and runs
in float32. The stored rows are a registered parameter, ``blocks`` (uint8, no gradient), so the model's parameters
count the bytes it holds. ``dequantized`` gives float32 rows (gguf-py's dequantisation, the values the float path
computes with; from the kernels' library where it runs, the same bits) for the callers that need values: the
embedding's lookup, a fingerprint, a reduced head, training.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from cats.model.kernels import quantized

FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # GGUF type code -> its torch dtype
GROUPS = WeakIdKeyDictionary()  # first module of a fused group -> (its key, its `quantized.Group`, its output order)


def file_rows(array: np.ndarray) -> torch.Tensor:
    """A tensor over ``array`` (a read-only view of the memory-mapped file) without a copy."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": the weights are never written
        return torch.from_numpy(array)


class GGUFRows(nn.Module):
    """A GGUF tensor's rows (``blocks``: uint8 ``[rows, row bytes]``) of ``columns`` values each, type ``type_code``.
    ``order``: where the model's row order differs from the file's (llama.cpp's converter reorders Llama's q and k),
    row i of the model is stored row ``order[i]``; the rows stay as stored (no copy) and outputs are reordered."""

    def __init__(self, blocks: torch.Tensor, type_code: int, columns: int, order: torch.Tensor | None = None):
        super().__init__()
        self.blocks = nn.Parameter(blocks, requires_grad=False)
        self.type_code, self.columns = type_code, columns
        self.register_buffer("order", None if order is None else order.to(torch.long), persistent=False)

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.type_code).name

    def dequantized(self, index=slice(None)) -> torch.Tensor:
        """Rows ``index`` (a slice or a tensor of row numbers, in the model's order) as float32 ``[n, columns]``: from
        the quantised kernels' library where it runs (`quantized.dequantized_rows`, the same values), else gguf-py."""
        if self.order is not None:
            index = self.order[index].reshape(-1)
        if quantized.unavailable() is None and quantized.supports(self.type_code, self.columns):
            if isinstance(index, slice):
                index = None if index == slice(None) else torch.arange(self.blocks.shape[0])[index]
            return quantized.dequantized_rows(self.blocks, self.type_code, self.columns, index)
        rows = self.blocks[index] if isinstance(index, slice) else self.blocks.index_select(0, index.reshape(-1).cpu())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            values = dequantize(rows.numpy(), GGMLQuantizationType(self.type_code))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(-1, self.columns))


class GGUFLinear(GGUFRows):
    """``nn.Linear`` on a GGUF tensor's stored rows: float32 in, float32 out, computed on the blocks."""

    def __init__(self, blocks: torch.Tensor, type_code: int, columns: int, bias: torch.Tensor | None = None,
                 order: torch.Tensor | None = None):
        super().__init__(blocks, type_code, columns, order)
        self.in_features, self.out_features = columns, blocks.shape[0]
        if bias is not None and order is not None:  # the kernels add it in the stored order
            bias = torch.empty_like(bias).index_copy_(0, self.order, bias)
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.float32).contiguous(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The whole weight as float32 ``[out, in]`` (a new tensor each call: the model holds only the blocks)."""
        return self.dequantized()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = quantized.linear(hidden, self.blocks, self.type_code, self.columns, self.bias)
        return out if self.order is None else out.index_select(-1, self.order)

    def gathered(self, index: torch.Tensor) -> "GGUFLinear":
        """A copy of rows ``index`` (in the model's order) as the file stores them, on the same kernels: row i of
        the copy is row ``index[i]``."""
        stored = index.cpu() if self.order is None else self.order[index.cpu()]
        bias = None if self.bias is None else self.bias.index_select(0, stored)
        return GGUFLinear(self.blocks.index_select(0, stored).contiguous(), self.type_code, self.columns, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, type={self.type_name}"


class GGUFEmbedding(GGUFRows):
    """``nn.Embedding`` on a GGUF tensor's stored rows: each looked-up row is dequantised to float32 (and multiplied by
    ``scale`` where the model scales its embedding, as Gemma3 does)."""

    compute_dtype = torch.float32

    def __init__(self, blocks: torch.Tensor, type_code: int, columns: int, scale: float | None = None):
        super().__init__(blocks, type_code, columns)
        self.num_embeddings, self.embedding_dim, self.scale = blocks.shape[0], columns, scale

    @property
    def weight(self) -> torch.Tensor:
        """The whole table as float32 (a new tensor each call)."""
        return self.dequantized()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.dequantized(ids).reshape(*ids.shape, self.columns)
        return rows if self.scale is None else rows * torch.tensor(self.scale, dtype=torch.float32)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.type_name}"


def fused_gguf_linear(hidden: torch.Tensor, modules) -> torch.Tensor | None:
    """The outputs of ``modules`` (`GGUFLinear`\ s reading the same input: q, k and v; gate and up) side by side, from
    one kernel call (`quantized.linears`: the input quantised once, one thread team); None unless every one of them
    is a `GGUFLinear` of the same input width. The call's arguments are made once, kept in `GROUPS` by the first
    module (outside it: a module is deep-copied by adapters, and ctypes pointers cannot be)."""
    first = modules[0]
    if not all(isinstance(module, GGUFLinear) and module.columns == first.columns for module in modules):
        return None
    group = GROUPS.get(first)
    # a streamed layer's parameters are views of whichever buffer holds it, all at fixed offsets in it: where its
    # first rows are tells where all of them are
    key = ([id(m) for m in modules], first.blocks.data_ptr())
    if group is None or group[0] != key:
        group = (key, _group(modules), _joined_order(modules))
        GROUPS[first] = group
    out = quantized.linears(hidden, group[1])
    return out if group[2] is None else out.index_select(-1, group[2])


def layer_groups(linears) -> tuple | None:
    """For the whole-layer kernel (`cats.model.kernels.layer_forward`): the linears q, k, v, o, gate, up, down of a
    Llama-style layer as four `quantized.Group`\ s ([q; k; v], o, [gate; up], down) and the order of [q; k] (int64:
    column j in the model's order is column ``order[j]`` of the group's output; None where stored in the model's
    order); None unless all seven are `GGUFLinear`\ s whose rows only q and k reorder."""
    if not all(isinstance(module, GGUFLinear) for module in linears):
        return None
    q, k, v, o, gate, up, down = linears
    if any(module.order is not None for module in (v, o, gate, up, down)):
        return None
    qk_order = _joined_order((q, k))
    return (_group((q, k, v)), _group((o,)), _group((gate, up)), _group((down,)),
            None if qk_order is None else qk_order.contiguous())


def _group(modules) -> quantized.Group:
    """``modules`` (`GGUFLinear`\ s of one input width) as one `quantized.Group`, in their stored row order."""
    return quantized.Group([(m.blocks, m.type_code, m.bias) for m in modules], modules[0].columns)


def _joined_order(modules) -> torch.Tensor | None:
    """The output order of `quantized.linears` over ``modules`` side by side (None: each in its stored order)."""
    if all(module.order is None for module in modules):
        return None
    parts, start = [], 0
    for module in modules:
        rows = module.out_features
        parts.append(start + (torch.arange(rows) if module.order is None else module.order))
        start += rows
    return torch.cat(parts)


def dequantize_linears(module: nn.Module) -> nn.Module:
    """Replace every `GGUFLinear` inside ``module`` by an ``nn.Linear`` of its float32 values, in place (an adapter's
    trainable copy of a target layer is float, whatever the target computes on); returns ``module``. A layer that
    streams under a memory budget holds no blocks (meta tensors): its linears become float linears on the meta
    device too, for an adapter's own weights to be assigned to."""
    for name, child in list(module.named_modules()):
        if not isinstance(child, GGUFLinear):
            continue
        streamed = child.blocks.is_meta
        linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, dtype=torch.float32,
                           device="meta" if streamed else None)
        if streamed:
            module.set_submodule(name, linear)
            continue
        with torch.no_grad():
            linear.weight.copy_(child.dequantized())
            if child.bias is not None:
                linear.bias.copy_(child.bias)
        module.set_submodule(name, linear)
    return module


STORED_FLOAT_TYPES = {dtype: code for code, dtype in FLOAT_TYPES.items()}  # torch dtype -> its GGUF type code
# from this many tokens a call a `StoredLinear` multiplies with torch (oneDNN) in its stored dtype: the F16/BF16/F32
# kernels reload each row per 4 tokens (Qwen2.5-Coder's 8960 x 1536 BF16 MLP rows, 2 threads, AMX Xeon: kernel 0.71
# / 1.56 / 6.22 ms for 1 / 4 / 16 tokens, torch bfloat16 1.03 / 1.09 / 1.12 ms)
TORCH_FROM_TOKENS = 2


class StoredLinear(GGUFLinear):
    """A trained float linear kept as its own F32/F16/BF16 rows (`stored_linears`): one token runs on the kernels
    (reading half the bytes of float32 for BF16), more tokens on torch's matrix product in the stored dtype (the
    input rounded to it, as in bfloat16 training). Linears that `fused_gguf_linear` joins (an adapter block's q, k
    and v) stay on the kernels at any length: one call over their joined rows is as fast as three torch products
    (Qwen2.5-Coder's attention-only adapters, 2 threads, AVX-512: 1.39 / 1.92 ms a block for 17 / 33 tokens,
    against 1.40 / 2.17 with each on torch). Only drafts and the cascade's filter compute on adapters, so their
    rounding never changes the output."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.numel() // self.columns < TORCH_FROM_TOKENS:
            return super().forward(hidden)
        values = self.blocks.view(FLOAT_TYPES[self.type_code])
        bias = None if self.bias is None else self.bias.to(values.dtype)
        return nn.functional.linear(hidden.to(values.dtype), values, bias).to(torch.float32)


def stored_linears(module: nn.Module) -> int:
    """Replace every float ``nn.Linear`` inside ``module`` by a `StoredLinear` over its own weight's bytes (F32, F16 or
    BF16 rows: no copy, no rounding), in place; returns how many. A trained adapter loaded onto a model on GGUF blocks
    computes on the kernels in the dtype its file stores (bfloat16 adapters: half the bytes of float32 copies, and
    half the bytes every draft step reads)."""
    replaced = 0
    for name, child in list(module.named_modules()):
        if not name or not isinstance(child, nn.Linear) or child.weight.dtype not in STORED_FLOAT_TYPES:
            continue
        weight = child.weight.detach().contiguous()
        rows = weight.view(torch.uint8).reshape(weight.shape[0], -1)
        bias = None if child.bias is None else child.bias.detach()
        module.set_submodule(name, StoredLinear(rows, STORED_FLOAT_TYPES[weight.dtype], child.in_features, bias))
        replaced += 1
    return replaced


def kernel_path() -> str:
    """What the quantised linears run on here, for reports: ``avx512``/``avx2`` kernels, or why none."""
    reason = quantized.unavailable()
    return f"gguf-blocks/{quantized.isa()}" if reason is None else f"unavailable ({reason})"
