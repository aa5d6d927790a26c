"""What each method needs resident under a memory budget (`MemoryNeeds`): the layers its draft steps run, its adapters
as the model will hold them (`HeldAs`), and the largest pass it verifies; the registry (`cats.methods`) names one
of these per method."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cats.config import DraftConfig
from cats.draft.dytc.build import pass_sizes as dytc_pass_sizes
from cats.draft.eagle import TOTAL_TOKENS as EAGLE_TOKENS
from cats.draft.layer_skip.drafter import NUM_TOKENS as LAYER_SKIP_TOKENS
from cats.draft.layer_skip.drafter import TREE_DEPTH as LAYER_SKIP_TREE_DEPTH
from cats.draft.layer_skip.drafter import TREE_TOKENS as LAYER_SKIP_TREE_TOKENS
from cats.draft.recycle import TOTAL_TOKENS as RECYCLE_TOKENS
from cats.draft.recycle import table_bytes as recycle_table_bytes
from cats.draft.sizing import BUCKETS, pass_tokens
from cats.errors import InvalidArgumentError
from cats.model.adapter import find_adapter, find_draft_adapter, read_adapter_config
from cats.model.eagle3 import find_eagle3_folder
from cats.model.kernels.gguf_modules import STORED_FLOAT_TYPES
from cats.model.streamed_head import draft_vocabulary_size
from cats.model.weights.budget import MemoryNeeds, numel
from cats.model.weights.parts import read_header


def _recorded_agreement(folder: Path) -> float | None:
    """The held-out agreement a trained head's card records (``training.final_eval``), else None."""
    try:
        return float(json.loads((folder / "config.json").read_text())["training"]["final_eval"]["agreement"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def dytc_eagle3_folder(adapters: str | None) -> Path | None:
    """The EAGLE-3 head dytc drafts with: ``DIR/eagle3/``, unless ``DIR/feature/`` records a higher held-out
    agreement than the head does (then dytc keeps the feature adapter); None without a head."""
    eagle3 = find_eagle3_folder(adapters)
    if eagle3 is None:
        return None
    head, feature = _recorded_agreement(eagle3), _recorded_agreement(Path(adapters) / "feature")
    return None if head is not None and feature is not None and feature > head else eagle3


@dataclass(frozen=True)
class HeldAs:
    """How a loaded adapter or head holds its file's tensors: in the model's dtype (``itemsize`` bytes a value), but
    its matrices as the file stores them where the model computes on GGUF blocks (``stored_matrices``: they become
    kernel linears over the file's own bytes, `cats.model.kernels.gguf_modules.stored_linears`)."""

    itemsize: int
    stored_matrices: bool = False

    def bytes_of(self, weights: Path) -> int:
        """The resident bytes of the tensors in the safetensors file ``weights``."""
        return sum(entry.end - entry.begin if self.stored_matrices and len(entry.shape) == 2
                   and entry.dtype in STORED_FLOAT_TYPES else numel(entry.shape) * self.itemsize
                   for entry in read_header(weights).entries.values())


def adapter_bytes(folder: Path, held: HeldAs) -> tuple[int, int, int]:
    """``(layer, resident bytes, head rows)`` of an adapter folder: its block and norm as ``held``, and the number of
    lm_head rows it gathers once for a reduced draft vocabulary (the plan prices them as the head holds its rows:
    `cats.model.weights.budget.MemoryPlan.adapter_bytes`)."""
    config = read_adapter_config(Path(folder))  # a damaged config or weights file: a clear error naming it
    return config.layer, held.bytes_of(Path(folder) / "model.safetensors"), len(config.vocab_subset or [])


def _add_adapter(needs: MemoryNeeds, folder: Path, held: HeldAs) -> int:
    """Count the adapter in ``folder`` (its bytes, head rows and KV-cache layer) in ``needs``; returns its layer."""
    layer, size, rows = adapter_bytes(folder, held)
    needs.adapter_bytes += size
    needs.head_rows += rows
    needs.extra_cache_layers += 1
    needs.prompt_captures = True  # it runs on the prompt's states at its layer
    return layer


def no_needs(needs: MemoryNeeds, config, held: HeldAs, d: DraftConfig) -> None:
    pass


def pld_needs(needs, config, held, d):
    needs.max_tree_tokens = (d.num_draft_tokens or 10) + 1


def recycle_needs(needs, config, held, d):  # drafts from its table: no layer must stay resident
    needs.max_tree_tokens = (d.total_tokens or RECYCLE_TOKENS) + 1
    needs.drafter_bytes = recycle_table_bytes(config.vocab_size)


def eagle_needs(needs, config, held, d):  # drafts from the final features: no target layer must stay
    if d.adapters is not None:
        _add_adapter(needs, find_adapter(d.adapters, "feature"), held)
    needs.max_tree_tokens = (d.total_tokens or EAGLE_TOKENS) + 1  # a fixed tree size, not left to the budget


def _eagle3_head_needs(needs, config, held, folder: Path | None) -> bool:
    """The resident bytes and cache layer of the EAGLE-3 head in ``folder``; whether there is one."""
    if folder is None:
        return False
    vocab = len(json.loads((folder / "config.json").read_text()).get("vocab_subset") or [])
    needs.adapter_bytes += held.bytes_of(folder / "model.safetensors")
    needs.head_rows += vocab
    needs.extra_cache_layers += 1
    needs.prompt_captures = True  # three layers' states of the prompt
    return True


def eagle3_needs(needs, config, held, d):  # drafts from three layers' states: no target layer must stay
    _eagle3_head_needs(needs, config, held, find_eagle3_folder(d.adapters))
    needs.max_tree_tokens = (d.total_tokens or EAGLE_TOKENS) + 1


def _adapter_needs(needs, config, held, d, early_exit: bool = False, shallow: bool = False) -> list[int]:
    """The resident adapters' bytes; returns the draft adapter's layer (empty without adapters)."""
    layers = []
    if d.adapters is None:
        return layers
    layers.append(_add_adapter(needs, find_draft_adapter(d.adapters, early_exit), held))
    if shallow:
        needs.shallow_layers = _add_adapter(needs, find_adapter(d.adapters, "shallow"), held)
    return layers


def _speculation_needs(needs, kind: str) -> None:
    needs.speculation = kind  # left to the budget: plan_for reserves a bucket (`cats.model.weights.offload.plan_for`)
    needs.pass_sizes = tuple(pass_tokens(bucket, kind) for bucket in BUCKETS)
    needs.max_tree_tokens = max(needs.pass_sizes)
    if kind == "cascade":
        needs.bare_passes = {pass_tokens(bucket, kind): pass_tokens(bucket, "tree") for bucket in BUCKETS}


def early_exit_needs(needs, config, held, d):
    layers = _adapter_needs(needs, config, held, d, early_exit=True)
    needs.min_resident_layers = _draft_layers(layers, config, d)
    if d.num_draft_tokens is not None:
        needs.max_tree_tokens = d.num_draft_tokens + 1
    else:
        _speculation_needs(needs, "chain")


def tree_needs(needs, config, held, d, shallow: bool = False):
    layers = _adapter_needs(needs, config, held, d, shallow=shallow)
    needs.min_resident_layers = _draft_layers(layers, config, d)
    if d.total_tokens is not None:
        needs.max_tree_tokens = (2 * d.total_tokens if shallow else d.total_tokens) + 1  # cats: + corrections
    else:
        _speculation_needs(needs, "cascade" if shallow else "tree")


def cats_needs(needs, config, held, d):
    tree_needs(needs, config, held, d, shallow=True)


def layer_skip_shape(d: DraftConfig) -> dict:
    """layer-skip's draft shape: a chain of ``--num-draft-tokens``, or with ``--tree-topk`` above 1 a tree of
    ``--depth`` levels and ``--total-tokens`` nodes."""
    tree_topk = d.tree_topk or 1
    if tree_topk == 1:
        if d.depth is not None or d.total_tokens is not None:
            raise InvalidArgumentError("layer-skip drafts a chain of --num-draft-tokens unless --tree-topk is above 1: "
                                       "--depth and --total-tokens shape its trees only")
        return {"num_tokens": d.num_draft_tokens or LAYER_SKIP_TOKENS}
    if d.num_draft_tokens is not None:
        raise InvalidArgumentError("a layer-skip tree's length is --depth (--num-draft-tokens is its chain's)")
    depth = d.depth or LAYER_SKIP_TREE_DEPTH
    return {"num_tokens": depth, "tree_topk": tree_topk, "total_tokens": d.total_tokens or LAYER_SKIP_TREE_TOKENS}


def layer_skip_needs(needs, config, held, d):  # under a budget it skips the streamed layers (`_layer_skip`)
    _adapter_needs(needs, config, held, d)
    needs.min_resident_layers = 1  # as dytc's: layer 0 is the layer a draft can least do without
    needs.skip_streamed = True
    shape = layer_skip_shape(d)
    needs.max_tree_tokens = shape.get("total_tokens", shape["num_tokens"]) + 1
    _streamed_head_needs(needs, config, shape["num_tokens"])  # one read-out per depth


def _streamed_head_needs(needs, config, draft_tokens: int) -> None:
    """A skip draft without adapters may read out through the lm_head's draft-vocabulary rows while the head
    streams, where the plan finds that pays (`cats.model.streamed_head`)."""
    if not needs.adapter_bytes and not needs.head_rows:
        needs.head_draft_rows = draft_vocabulary_size(config.vocab_size)
        needs.draft_tokens = draft_tokens


def dytc_needs(needs, config, held, d):  # under a budget, layer skipping skips exactly the streamed layers (`_dytc`)
    head = _eagle3_head_needs(needs, config, held, dytc_eagle3_folder(d.adapters))
    layers = [] if head else _adapter_needs(needs, config, held, d)
    needs.min_resident_layers = _draft_layers(layers, config, d) if layers else 1  # layer 0 times its cost model
    needs.skip_streamed = True  # its layer-skip drafter skips what streams, where the model has a stream order
    needs.drafter_bytes = recycle_table_bytes(config.vocab_size)  # token recycling, one of its options
    _streamed_head_needs(needs, config, LAYER_SKIP_TOKENS)
    if d.total_tokens is not None:
        needs.max_tree_tokens = d.total_tokens + 1
    elif d.adapters is None:  # the skip chain, the recycling tree, the lookup chain grafted on it: left to the budget
        needs.pass_sizes = dytc_pass_sizes(d.num_draft_tokens)
        needs.max_tree_tokens = max(needs.pass_sizes)
    else:
        _speculation_needs(needs, "tree")


def _draft_layers(layers: list[int], config, d: DraftConfig) -> int:
    if not layers:
        layers = [d.draft_layer if d.draft_layer is not None else max(1, config.num_hidden_layers // 8)]
    return min(max(layers), config.num_hidden_layers)
