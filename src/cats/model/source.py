"""Where a model's files come from: a local HF folder, a ``.gguf`` file (or a folder holding one), or a Hub id.

A GGUF file is run on its own blocks (`cats.model.gguf_model`): its config, tokenizer and tensor index are converted
once into a small folder under the CATS cache (``$CATS_CACHE``, default ``~/.cache/cats``; `gguf_metadata`), and
its weights are memory-mapped from the file itself. For the float path (``--kernels aten``, or where the quantised
kernels cannot run) it is dequantised by transformers once and saved as a float32 safetensors folder there instead
(`local_folder`), so every later load is a plain safetensors load.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import re
import warnings
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from cats.cache_files import (Damaged, check_folder, clean_stale, discard, file_key, notice, staging_folder,
                              write_json, write_record)
from cats.errors import (
    CatsError,
    DamagedFileError,
    InvalidArgumentError,
    MissingDependencyError,
    ModelNotFoundError,
)
from cats.model.files import check_gguf, check_model_folder
from cats.model.gguf_names import shared_name_maps
from cats.model.layered import check_supported
from cats.paths import cache_root

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "float64": torch.float64, "fp64": torch.float64,
}


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
SOURCE_RECORD = "cats-source.json"  # in a converted folder: the GGUF file it came from and its files' records
LEGACY_CONVERSION_STAGING = re.compile(r".+-[0-9a-f]{16}\.[a-z0-9_]{8}")  # older CATS versions' staging folders


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise InvalidArgumentError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16, float64") from None


def load_tokenizer(model: str | os.PathLike):
    """The tokenizer of ``model`` alone (None when it has none), e.g. to size a memory plan before loading."""
    return load_tokenizer_from(config_folder(model), model)


def config_folder(model: str | os.PathLike) -> str:
    """A folder with ``model``'s config and tokenizer: a GGUF file's metadata folder (`gguf_metadata`: no weights
    converted), else the model's folder (`local_folder`)."""
    path = gguf_file(model)
    return str(gguf_metadata(path)) if path is not None else local_folder(str(model))


def load_tokenizer_from(folder: str, model):
    """The tokenizer in ``folder`` (None, with a warning, when there is none transformers can read)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as error:  # missing files (OSError), damaged tokenizer.json (various), unknown classes
        warnings.warn(f"model {str(model)!r} has no tokenizer CATS can read ({type(error).__name__}: "
                      f"{first_line(error)}); text prompts need one, token ids work without")
        return None
    drop_build_tables(tokenizer)
    return tokenizer


BUILD_TABLES = ("_vocab", "_merges")  # what transformers' BPE tokenizer classes build their backend from


def drop_build_tables(tokenizer) -> None:
    """Empty the Python copies of the vocabulary and merges that transformers 5's tokenizer classes (GPT-2, Llama,
    Qwen2, Gemma, ...) build their Rust backend from and then keep, read by nothing after ``__init__``: for Qwen2's
    151,936 tokens they hold ~60 MB, which a process under a memory budget would otherwise take from the weights.
    The backend keeps its own tables; encoding, decoding, chat templates and ``get_vocab`` read those."""
    for name in BUILD_TABLES:
        table = getattr(tokenizer, name, None)
        if isinstance(table, (dict, list)) and getattr(tokenizer, "_tokenizer", None) is not None:
            setattr(tokenizer, name, type(table)())


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def gguf_file(model: str | os.PathLike) -> Path | None:
    """The ``.gguf`` file ``model`` names (the file, or the one in a folder without a config.json), else None."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return None


TENSOR_INDEX = "tensors.json"  # in a GGUF's metadata folder: every tensor's type, shape and bytes in the file


def gguf_metadata(gguf_path: Path) -> Path:
    """The metadata folder of a GGUF file, made once: its config (``config.json``, as transformers reads it), its
    tokenizer, and ``tensors.json``, each tensor's name, GGUF type code, shape (rows, columns) and byte range in
    the file. Keyed by the file's path, size and modification time (the weights stay in the file: no copy), written
    through a staging folder and checked against its record as `convert_gguf`'s folder is."""
    if importlib.util.find_spec("gguf") is None:
        raise MissingDependencyError(f"loading {gguf_path.name} needs the 'gguf' package: pip install gguf")
    resolved = gguf_path.resolve()
    target = cache_root() / "gguf-metadata" / f"{gguf_path.stem}-{file_key(resolved)}"
    clean_stale(target.parent)
    try:
        check_folder(target, SOURCE_RECORD)
        return target
    except FileNotFoundError:
        pass
    except Damaged as damage:
        notice(f"the metadata of {gguf_path.name} is damaged: {damage}; reading it again")
        discard(target)
    check_gguf(gguf_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    notice(f"reading the config, tokenizer and tensor index of {gguf_path.name}, once; cached in {target}")
    try:
        with staging_folder(target) as staging, gguf_parsed_once():
            folder, name = str(gguf_path.parent), gguf_path.name
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
            check_supported(config)
            _drop_out_of_vocabulary_token_ids(config, name)
            config_dict = config.to_dict()
            config_dict.pop("quantization_config", None)
            (staging / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True))
            try:
                AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(staging)
            except Exception as error:  # some GGUF tokenizers (llama2.c conversions) are not readable by transformers
                warnings.warn(f"could not convert the tokenizer of {name}: {first_line(error)}")
            reader = importlib.import_module("gguf").GGUFReader(resolved, "r")
            tensors = {tensor.name: {"type": int(tensor.tensor_type), "shape": [int(n) for n in tensor.shape[::-1]],
                                     "offset": int(tensor.data_offset), "bytes": int(tensor.n_bytes)}
                       for tensor in reader.tensors}
            architecture = reader.get_field("general.architecture")
            index = {"architecture": architecture.contents() if architecture is not None else None,
                     "file_bytes": resolved.stat().st_size, "tensors": tensors}
            (staging / TENSOR_INDEX).write_text(json.dumps(index))
            write_record(staging, SOURCE_RECORD, {"gguf": str(resolved)})
    except CatsError:
        raise
    except Exception as error:  # gguf-py and transformers raise ValueError, IndexError, KeyError, ... on damage
        raise DamagedFileError(gguf_path, f"could not be read ({type(error).__name__}: {first_line(error)})",
                               "if the file is damaged, re-download it") from error
    return target


def local_folder(model: str) -> str:
    """Map the user's model argument to something ``from_pretrained`` can read without further guessing."""
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"{model!r} is a file but not a .gguf file; pass a model folder, a .gguf file or a Hub id")
        return _converted(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return str(path)  # its weights are checked once its architecture is known (`load_model`)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _converted(ggufs[0])
        if len(ggufs) > 1:
            names = ", ".join(p.name for p in ggufs)
            raise ModelNotFoundError(f"folder {model!r} holds several .gguf files ({names}); pass one of them")
        raise ModelNotFoundError(f"folder {model!r} has neither a config.json nor a .gguf file")
    looks_like_path = model.startswith((".", "/", "~")) or model.lower().endswith(".gguf") or os.sep in model.strip("/").replace("/", "", 1)
    if looks_like_path or not HUB_ID.match(model):
        raise ModelNotFoundError(f"model path {model!r} does not exist")
    return _hub_snapshot(model)


def _hub_snapshot(repo_id: str) -> str:
    """Download (or find in the HF cache) a Hub model's files; a clear error when neither works."""
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as error:  # network errors, unknown repos, gated repos: all mean "cannot get it"
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local path and could not be fetched from the Hugging Face Hub "
            f"({type(error).__name__}: {first_line(error)})"
        ) from None
    check_model_folder(folder, f"delete the folder {folder} (the Hugging Face cache's copy) and run again to download it")
    return folder


def _converted(gguf_path: Path) -> str:
    """The converted folder of a GGUF file (the file is checked by `check_gguf` before it is converted), what the
    conversion raises on a file that passed the check reported as one line naming it, the cached result checked
    after."""
    try:
        folder = convert_gguf(gguf_path)
    except CatsError:
        raise
    except Exception as error:  # gguf-py and transformers raise ValueError, IndexError, KeyError, ... on damage
        raise DamagedFileError(gguf_path, f"could not be converted by transformers ({type(error).__name__}: "
                                          f"{first_line(error)})", "if the file is damaged, re-download it") from error
    check_model_folder(folder, f"delete the folder {folder} (the converted copy in the CATS cache) and run again")
    return str(folder)


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _save_plain(hf_model, folder: Path) -> None:
    """Save dequantised weights as a plain safetensors folder (``save_pretrained`` refuses GGUF-loaded models)."""
    from safetensors.torch import save_model

    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if getattr(hf_model, "generation_config", None) is not None:
        hf_model.generation_config.save_pretrained(folder)
    save_model(hf_model, str(folder / "model.safetensors"), metadata={"format": "pt"})  # tied weights stored once


def _drop_out_of_vocabulary_token_ids(config, name: str) -> None:
    """Some GGUF files (e.g. llama.cpp conversions of llama2.c models) store 0xFFFFFFFF for "no such token";
    transformers would build an embedding with that padding index and fail. Such ids mean "none"."""
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not 0 <= value < config.vocab_size:
            warnings.warn(f"{name}: {key}={value} lies outside the {config.vocab_size}-token vocabulary; ignored")
            setattr(config, key, None)


@contextlib.contextmanager
def gguf_parsed_once():
    """While converting one file: gguf-py's reader and tensor-name map built once.

    transformers parses a GGUF file's metadata three times, for the config, the weights and the tokenizer (gguf-py's
    reader takes ~3 s each on SmolLM2's 49k-token vocabulary), and builds gguf-py's tensor-name map once per module
    of the model (~400 times); both are pure functions of their arguments, so within one conversion they are built
    once and reused (the converted files are byte for byte the same). gguf's own names are restored after."""
    gguf = importlib.import_module("gguf")
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def parsed(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = parsed, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantise a GGUF file to a float32 safetensors folder in the cache, once; return that folder.

    The folder name carries the file's SHA-256, so a changed file is converted again. Conversion writes to a
    staging folder and renames it into place, so an interrupted conversion never looks finished; ``cats-source.json``
    records every file written with its size, modification time and CRC-32 (`verify_conversion`). A folder that does
    not match its record is converted again, with a one-line notice on stderr."""
    if importlib.util.find_spec("gguf") is None:
        raise MissingDependencyError(f"loading {gguf_path.name} needs the 'gguf' package: pip install gguf")
    target = cache_root() / "gguf" / f"{gguf_path.stem}-{_file_digest(gguf_path)[:16]}"
    clean_stale(target.parent, legacy=LEGACY_CONVERSION_STAGING)
    try:
        record = verify_conversion(target)
        if record.get("gguf") != str(gguf_path.resolve()):  # the same bytes, moved or copied since: the quantised
            with contextlib.suppress(OSError):               # blocks (`GGUFBlocks.of_checkpoint`) are read from here
                write_json(target / SOURCE_RECORD, {**record, "gguf": str(gguf_path.resolve())})
        return target
    except FileNotFoundError:
        pass
    except Damaged as damage:
        notice(f"the converted checkpoint is damaged: {damage}; converting {gguf_path.name} again")
        discard(target)
    check_gguf(gguf_path)  # only before converting: a cached conversion is keyed by the file's SHA-256
    target.parent.mkdir(parents=True, exist_ok=True)
    notice(f"converting {gguf_path.name} to a float32 safetensors checkpoint, once; cached in {target}")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # transformers' own bar over the tensors it de-quantizes
    try:
        with staging_folder(target) as staging:
            folder, name = str(gguf_path.parent), gguf_path.name
            with gguf_parsed_once(), shared_name_maps():
                config = AutoConfig.from_pretrained(folder, gguf_file=name)
                check_supported(config)
                _drop_out_of_vocabulary_token_ids(config, name)
                hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config,
                                                                dtype=torch.float32)
                _save_plain(hf_model, staging)
                try:
                    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(staging)
                except Exception as error:  # some GGUF tokenizers (llama2.c conversions) are not readable by transformers
                    warnings.warn(f"could not convert the tokenizer of {name}: {first_line(error)}")
            write_record(staging, SOURCE_RECORD, {"gguf": str(gguf_path.resolve())})
    finally:
        if not bars:
            hf_logging.disable_progress_bar()
    return target


def verify_conversion(folder: Path) -> dict:
    """Check a converted folder against ``cats-source.json``: every file it records is there with its size and,
    when its modification time changed, its CRC-32; return the record. Raises FileNotFoundError when nothing was
    converted there, `cats.cache_files.Damaged` when something does not match."""
    return check_folder(folder, SOURCE_RECORD)
