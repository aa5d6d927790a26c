"""The layer store: a model's weights split into one safetensors file per part (embeddings, final norm, lm_head,
each decoder layer), in the dtype the model runs in, made once and kept under ``$CATS_CACHE/layers/``.

Layout of a store folder::

    store.json          format, model fingerprint, dtype, source, and each part's file name, size, mtime_ns and
                        CRC-32 (`cats.cache_files`), with a CRC-32 of its own content
    embed.safetensors   model.embed_tokens (tensor names relative to the part's module: "weight")
    norm.safetensors    model.norm
    lm_head.safetensors lm_head (absent when tied to the embeddings)
    layer-000.safetensors ... one per decoder layer ("self_attn.q_proj.weight", ...)

Every part file is a valid safetensors file whose header is padded with spaces (the format allows it) so that the
tensor data starts at a multiple of 4096 bytes: a part is then read with one ``preadv`` (``O_DIRECT`` possible)
into a page-aligned buffer, and its tensors are views of that buffer.

A store is built from the checkpoint tensor by tensor (`build_from_checkpoint`: memory stays at one tensor, so a
model that does not fit in memory can still be stored) or from a model already in memory (`build_from_model`).
It is written into a staging folder, ``fsync``ed and renamed into place, so an interrupted build never looks
finished (a killed build's staging folder is removed by the next one); free disk space is checked before writing.
Opening checks ``store.json``'s own checksum, the format, the model fingerprint, the dtype, every file's size, and
the CRC-32 of every file whose modification time changed, so a truncated or overwritten file or a store of another
model is caught before any token is generated.

A store made from a GGUF file's checkpoint (the folder `cats.model.source.convert_gguf` writes) keeps each decoder
layer's weights in the file's own quantised blocks (`cats.model.weights.blocks`) wherever decoding them gives the
checkpoint's weights bit for bit (checked for every tensor when the store is made; rows may be in another order, as
transformers permutes Llama's q/k rows: the blocks are stored in the checkpoint's order). Such a tensor is a uint8
``[rows, bytes a row]`` tensor in the part file, and ``store.json`` records its kind, shape and dtype under the
part's ``coded``; `LayerStore.read` and the layer reader decode it. Everything else is stored plain.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cats.cache_files import (Damaged, check_files, clean_stale, describe_files, discard, notice, read_json,
                              staging_folder, write_json)
from cats.model.identity import fingerprint_of, fingerprint_rows
import cats.model.weights.blocks as blocks
from cats.model.weights.budget import MIB, STORE_ALIGNMENT, mib, round_up
from cats.model.weights.parts import (
    DTYPE_NAMES,
    SAFETENSORS_DTYPES,
    Checkpoint,
    PartHeader,
    StoreError,
    TensorEntry,
    data_layout,
    read_data,
    read_header,
    read_part,
    read_tensor,
    write_part,
)
from cats.paths import cache_root

FORMAT = "cats-layer-store/2"
META_FILE = "store.json"
LEGACY_STAGING = re.compile(r"\..+-[0-9a-f]{12}\.[a-z0-9_]{8}")  # older CATS versions' staging folders


# --------------------------------------------------------------------------------------------- part files
@dataclass(frozen=True)
class DecodedPart:
    """A part whose file holds some tensors as quantised blocks: ``entries`` is where its tensors lie, decoded, in
    a buffer of ``data_bytes`` (what `PartHeader` is for a plain part: same ``layout`` and ``views``)."""

    file: PartHeader
    coded: dict[str, str]  # tensor name -> block kind
    entries: dict[str, TensorEntry]
    data_bytes: int

    @classmethod
    def of(cls, header: PartHeader, coded: dict[str, dict]) -> "DecodedPart":
        specs = {}
        for name, entry in header.entries.items():
            info = coded.get(name)
            specs[name] = (SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"])) if info else (entry.dtype, entry.shape)
        entries, data_bytes = data_layout(specs)  # as `write_part` lays out a plain part: the plain layer's bytes
        return cls(header, {name: info["kind"] for name, info in coded.items()}, entries, data_bytes)

    @property
    def layout(self) -> tuple:
        return tuple((name, e.dtype, e.shape, e.begin, e.end) for name, e in sorted(self.entries.items()))

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: buffer[e.begin:e.end].view(e.dtype).view(e.shape) for name, e in self.entries.items()}

    def decode(self, raw: torch.Tensor, buffer: torch.Tensor) -> None:
        """Fill ``buffer`` (uint8, ``data_bytes`` or more) from ``raw`` (uint8, the file's data section)."""

        for name, entry in self.entries.items():
            stored = self.file.entries[name]
            source, target = raw[stored.begin:stored.end], buffer[entry.begin:entry.end]
            if name in self.coded:
                blocks.decode_into(self.coded[name], source, target.view(entry.dtype))
            else:
                target.copy_(source)


# --------------------------------------------------------------------------------------------- parts of a model
def part_name(layer: int) -> str:
    return f"layer-{layer:03d}"


def part_modules(hf_model) -> dict[str, tuple[str, torch.nn.Module]]:
    """``{part: (module path, module)}`` in store order; lm_head only when it is not tied to the embeddings."""
    decoder = hf_model.model
    parts = {"embed": ("model.embed_tokens", decoder.embed_tokens), "norm": ("model.norm", decoder.norm)}
    if hf_model.lm_head.weight is not decoder.embed_tokens.weight:
        parts["lm_head"] = ("lm_head", hf_model.lm_head)
    for i, layer in enumerate(decoder.layers[: hf_model.config.num_hidden_layers]):
        parts[part_name(i)] = (f"model.layers.{i}", layer)
    covered = {f"{prefix}.{name}" for prefix, module in parts.values() for name, _ in module.named_parameters()}
    missing = [name for name, _ in hf_model.named_parameters() if name not in covered]
    if missing:
        raise StoreError(f"parameters outside embeddings, norm, lm_head and layers cannot be stored yet: {missing[:5]}")
    return parts


def part_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


# --------------------------------------------------------------------------------------------- the store
@dataclass
class LayerStore:
    folder: Path
    meta: dict

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    def path(self, part: str) -> Path:
        return self.folder / self.meta["parts"][part]["file"]

    def header(self, part: str) -> PartHeader:
        return read_header(self.path(part))

    def layer_header(self, layer: int) -> PartHeader:
        return self.header(part_name(layer))

    def layout(self, part: str) -> PartHeader | DecodedPart:
        """Where the part's tensors lie in a buffer holding it: the file's own layout, or the decoded one when the
        part holds quantised blocks."""
        header, coded = self.header(part), self.meta["parts"][part].get("coded")
        return DecodedPart.of(header, coded) if coded else header

    def read(self, part: str) -> dict[str, torch.Tensor]:
        """A part's tensors (decoded), in freshly allocated memory."""
        layout = self.layout(part)
        if isinstance(layout, PartHeader):
            return read_part(layout)
        buffer = torch.empty(layout.data_bytes, dtype=torch.uint8)
        layout.decode(read_data(layout.file), buffer)
        return layout.views(buffer)

    def stored_layer_bytes(self) -> list[int]:
        """Bytes each decoder layer's file holds (what streaming it reads)."""
        return [self.layer_header(i).data_bytes for i in range(self.meta["num_layers"])]


def open_store(folder: Path, fingerprint: str, dtype: torch.dtype, num_layers: int, config=None) -> LayerStore:
    """Open and check a store: ``store.json``'s checksum, format, recorded model fingerprint, dtype, every part
    file's size (and CRC-32 when its modification time changed), and (with ``config``) the fingerprint of the
    lm_head it actually holds."""
    folder = Path(folder)
    meta_file = folder / META_FILE
    try:
        meta = read_json(meta_file)
    except FileNotFoundError:
        raise StoreError(f"{folder} is not a layer store (no {META_FILE})") from None
    except Damaged as damage:
        raise StoreError(f"cannot use {folder}: {damage}") from None
    if meta.get("format") != FORMAT:
        raise StoreError(f"{folder} is not a {FORMAT} layer store")
    if meta.get("fingerprint") != fingerprint:
        raise StoreError(f"layer store {folder} was made from another model (fingerprint {meta.get('fingerprint')}, "
                         f"this model's is {fingerprint}); remove it or choose another folder")
    if meta.get("dtype") != str(dtype).removeprefix("torch.") or meta.get("num_layers") != num_layers:
        raise StoreError(f"layer store {folder} holds {meta.get('num_layers')} layers in {meta.get('dtype')}, "
                         f"not {num_layers} in {str(dtype).removeprefix('torch.')}")
    try:
        if check_files(folder, {info["file"]: info for info in meta["parts"].values()}):
            write_json(meta_file, meta)  # same content, new modification times: not read again next time
    except Damaged as damage:
        raise StoreError(f"layer file {damage}; delete {folder} to rebuild the store") from None
    except OSError:  # a read-only store: checked again next time
        pass
    if any(info.get("coded") for info in meta["parts"].values()):

        reason = blocks.unavailable()
        if reason is not None:
            raise StoreError(f"layer store {folder} keeps layers in quantised blocks, but the block decoder is "
                             f"unavailable ({reason}); delete {folder} to rebuild the store with plain weights")
    store = LayerStore(folder, meta)
    if config is not None:

        head = store.header("lm_head" if "lm_head" in meta["parts"] else "embed")
        held = fingerprint_of(config, read_tensor(head, "weight", fingerprint_rows(head.entries["weight"].shape[0])))
        if held != fingerprint:
            raise StoreError(f"layer store {folder} holds the lm_head of another model (fingerprint {held}, this "
                             f"model's is {fingerprint}); remove it or choose another folder")
    return store


def default_store_folder(fingerprint: str, dtype: torch.dtype, source_digest: str) -> Path:

    return cache_root() / "layers" / f"{fingerprint}-{str(dtype).removeprefix('torch.')}-{source_digest[:12]}"


def ensure_store(folder: Path | None, fingerprint: str, dtype: torch.dtype, config, source: dict,
                 parts: dict[str, int], write) -> LayerStore:
    """Open the store, or build it with ``write(staging_folder) -> {part: file size}`` when it is absent.

    ``folder`` None: the default folder under ``$CATS_CACHE/layers`` (named by fingerprint, dtype and source); a
    damaged store there is rebuilt. An explicit folder is never overwritten: a store of another model or a damaged
    one there is an error. ``parts`` maps each part to its data bytes (for the free-space check). ``write``
    returns each part's file size, or ``{"size": ..., "coded": {tensor: {"kind", "shape", "dtype"}}}`` for a part
    holding quantised blocks."""
    explicit, num_layers = folder is not None, config.num_hidden_layers
    folder = Path(folder) if explicit else default_store_folder(fingerprint, dtype, source["digest"])
    clean_stale(folder.parent, folder.name if explicit else None, None if explicit else LEGACY_STAGING)
    if (folder / META_FILE).is_file() or (not explicit and folder.exists()):
        try:
            return open_store(folder, fingerprint, dtype, num_layers, config)
        except StoreError as error:
            if explicit:
                raise
            notice(f"rebuilding the layer store: {str(error).partition('; delete ')[0]}")  # rebuilt, not deleted by hand
            discard(folder)
    elif explicit and folder.exists() and any(folder.iterdir()):
        raise StoreError(f"{folder} exists and is not a layer store; pass an empty or new folder")
    build(folder, fingerprint, dtype, num_layers, source, parts, write)
    return open_store(folder, fingerprint, dtype, num_layers, config)


def build(folder: Path, fingerprint: str, dtype: torch.dtype, num_layers: int, source: dict, parts: dict[str, int],
          write) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    needed = sum(round_up(size) + 2 * STORE_ALIGNMENT for size in parts.values()) + MIB
    free = shutil.disk_usage(folder.parent).free
    if free < needed:
        raise StoreError(f"no room for the layer store: it needs {mib(needed)} in {folder.parent}, only {mib(free)} "
                         "are free; free some disk space or set CATS_CACHE to a larger disk")
    print(f"cats: writing the layer store for the memory budget, once ({mib(needed)}); cached in {folder}",
          file=sys.stderr, flush=True)
    try:
        with staging_folder(folder) as staging:
            infos = write(staging)
            files = describe_files(staging, [f"{part}.safetensors" for part in infos])
            parts = {part: {"file": f"{part}.safetensors", **(info if isinstance(info, dict) else {"size": info}),
                            **files[f"{part}.safetensors"]} for part, info in infos.items()}
            write_json(staging / META_FILE, {
                "format": FORMAT, "fingerprint": fingerprint, "dtype": str(dtype).removeprefix("torch."),
                "num_layers": num_layers, "source": source, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "parts": parts})
    except OSError as error:
        raise StoreError(f"writing the layer store in {folder.parent} failed: {error.strerror or error}") from None
    except Damaged as damage:
        raise StoreError(f"writing the layer store in {folder.parent} failed: {damage}") from None


# --------------------------------------------------------------------------------------------- building
def model_source(hf_model) -> dict:
    """Source record of a model in memory: a digest of a strided sample of every tensor (so that two different
    models with the same lm_head, e.g. fine-tunes, never share a store)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(hf_model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 64)][:64].to(torch.float64)
        digest.update(name.encode() + sample.numpy().tobytes())
    return {"kind": "memory", "digest": digest.hexdigest()}


def write_from_model(hf_model):
    """A ``write`` function for `ensure_store` that stores the parameters of a model in memory."""
    def write(staging: Path) -> dict[str, int]:
        return {part: write_part(staging / f"{part}.safetensors", dict(module.named_parameters()))
                for part, (_, module) in part_modules(hf_model).items()}
    return write


def tied_aliases(hf_model) -> dict[str, str]:
    """Tied parameter names in both directions (a tied checkpoint stores one of them, which one varies)."""
    tied = dict(getattr(hf_model, "all_tied_weights_keys", None) or {})
    return {**tied, **{source: target for target, source in tied.items()}}


def write_from_checkpoint(checkpoint: Checkpoint, hf_model, dtype: torch.dtype, blocks=None):
    """A ``write`` function for `ensure_store` that copies a checkpoint into parts, converted to ``dtype``, with
    one part in memory at a time (the checkpoint is read with ``pread``, never mapped whole). ``hf_model``
    (parameters may be on the meta device) gives the part structure. ``blocks`` (`cats.model.weights.blocks.GGUFBlocks`,
    the GGUF file the checkpoint came from): decoder layers keep the file's quantised blocks for every tensor they
    decode to bit for bit."""
    aliases = tied_aliases(hf_model)

    def write(staging: Path) -> dict[str, int | dict]:
        infos = {}
        for part, (prefix, module) in part_modules(hf_model).items():
            tensors = {name: checkpoint.read(f"{prefix}.{name}", aliases).to(dtype) for name, _ in module.named_parameters()}
            for name, parameter in module.named_parameters():
                if tuple(tensors[name].shape) != tuple(parameter.shape):
                    raise StoreError(f"checkpoint tensor {prefix}.{name} has shape {list(tensors[name].shape)}, the "
                                     f"model expects {list(parameter.shape)}")
            coded = blocks.encode(int(part.removeprefix("layer-")), tensors) if (
                blocks is not None and part.startswith("layer-")) else {}
            stored = {name: coded[name][1] if name in coded else tensor for name, tensor in tensors.items()}
            size = write_part(staging / f"{part}.safetensors", stored)
            infos[part] = {"size": size, "coded": {
                name: {"kind": kind, "shape": list(tensors[name].shape), "dtype": DTYPE_NAMES[dtype]}
                for name, (kind, _) in coded.items()}} if coded else size
            del tensors, stored, coded
        return infos
    return write
