"""Loading from HF folders, GGUF files (converted once, cached) and Hub ids, with clear errors."""

from __future__ import annotations

import ctypes
import json

import pytest
import torch
from transformers import AutoTokenizer, Qwen2Tokenizer

import cats
import cats.model.source as load_module
from cats.errors import MissingDependencyError, ModelNotFoundError, UnsupportedArchitectureError
from cats.model.source import config_folder, load_tokenizer_from
from cats.model.weights.rss import anonymous_rss_bytes, return_freed_memory
from tests.conftest import SMOLLM2, STORIES_GGUF, STORIES_HF, needs


@needs(STORIES_HF)
def test_hf_folder_loads_with_tokenizer_and_dtype():
    model = cats.load_model(STORIES_HF, dtype="bfloat16")
    assert model.num_layers == 5 and model.dtype == torch.bfloat16
    assert model.tokenizer is not None and model.eos_token_ids == {2}
    assert model.name == str(STORIES_HF)


@needs(STORIES_GGUF)
def test_gguf_is_converted_once_and_matches_the_hf_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("CATS_CACHE", str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="tokenizer"):  # llama2.c GGUF tokenizers are not readable by transformers
        from_gguf = cats.load_model(STORIES_GGUF, kernels="aten")
    converted = list((tmp_path / "cache" / "gguf").iterdir())
    assert len(converted) == 1 and (converted[0] / "model.safetensors").is_file()
    assert json.loads((converted[0] / "cats-source.json").read_text())["gguf"] == str(STORIES_GGUF.resolve())
    reference = cats.load_model(STORIES_HF)
    ids = torch.tensor([1, 400, 30, 87, 5])
    with torch.no_grad():
        assert torch.equal(from_gguf.forward(ids, from_gguf.new_cache()), reference.forward(ids, reference.new_cache()))

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(load_module, "_save_plain", no_second_conversion)
    with pytest.warns(UserWarning):
        cats.load_model(STORIES_GGUF.parent, kernels="aten")  # a folder holding one .gguf file: the cached conversion is reused


def test_gguf_without_gguf_package_is_a_clear_error(tmp_path, monkeypatch):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")
    real_find_spec = load_module.importlib.util.find_spec
    monkeypatch.setattr(load_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    with pytest.raises(MissingDependencyError, match="pip install gguf"):
        cats.load_model(fake)


def test_missing_paths_and_unreachable_hub_ids(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        cats.load_model(tmp_path / "no-such-model")
    with pytest.raises(ModelNotFoundError, match="neither a config.json nor a .gguf"):
        cats.load_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        cats.load_model(tmp_path / "weights.bin")
    with pytest.raises(ModelNotFoundError, match="Hugging Face Hub"):
        cats.load_model("cats-tests-nonexistent-org/no-such-model-4711")


def test_unsupported_architecture_is_rejected_before_loading_weights(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)  # no weights at all
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2'.*supports"):
        cats.load_model(tmp_path)


def test_unknown_dtype():
    with pytest.raises(cats.InvalidArgumentError, match="dtype"):
        load_module.resolve_dtype("int3")


@needs(SMOLLM2)
def test_tokenizer_keeps_no_python_copy_of_its_tables(tmp_path):
    """transformers' BPE tokenizer classes (here Qwen2's, made from SmolLM2's vocabulary and merges) keep the tables
    they were built from; CATS empties them (memory a budget would otherwise charge) and the tokenizer's behaviour
    is unchanged."""
    smollm2 = AutoTokenizer.from_pretrained(config_folder(SMOLLM2))
    merges = json.loads(smollm2.backend_tokenizer.to_str())["model"]["merges"]
    Qwen2Tokenizer(vocab=smollm2.get_vocab(), merges=[tuple(merge) for merge in merges]).save_pretrained(tmp_path)
    tokenizer = load_tokenizer_from(str(tmp_path), tmp_path)
    reference = AutoTokenizer.from_pretrained(tmp_path)
    assert type(tokenizer) is type(reference) is Qwen2Tokenizer
    assert len(reference._vocab) == 49152 and len(reference._merges) == len(merges)  # what transformers keeps
    assert tokenizer._vocab == {} and tokenizer._merges == []
    text = "def f(x):\n    return x ** 2  # squares, naïvely"
    assert tokenizer(text)["input_ids"] == reference(text)["input_ids"]
    ids = reference(text)["input_ids"]
    assert tokenizer.decode(ids) == reference.decode(ids) == text
    assert tokenizer.get_vocab() == reference.get_vocab()


def test_return_freed_memory_trims_the_c_heap():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(4096) for _ in range(50_000)]  # ~200 MB of small blocks: heap memory, not mappings
    pin = libc.malloc(4096)  # above them: the heap's top stays in use, so free() alone returns nothing
    for block in blocks:
        ctypes.memset(block, 1, 4096)
    for block in blocks:
        libc.free(block)
    held = anonymous_rss_bytes()
    assert return_freed_memory()
    assert anonymous_rss_bytes() < held - (100 << 20)
    libc.free(pin)
