"""The per-layer store: aligned safetensors part files, building from a checkpoint or a model in memory, and the
faults: a truncated layer file (at open and while streaming), a store of another model, no free disk."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from cats.cache_files import write_json
from cats.errors import InvalidArgumentError
from cats.config import GenerationConfig
from cats.loop.generator import Generator
from cats.model.weights import MemoryNeeds, StoreError, offload_model, plan_for
from cats.model.weights.budget import STORE_ALIGNMENT
from cats.model.weights.parts import read_header, read_part, write_part
from cats.model.load import load_model
from tests.conftest import hf_greedy, tiny_model

NEEDS = MemoryNeeds(context_tokens=64, min_resident_layers=1, max_tree_tokens=17, prefetch=1)
PROMPT = [5, 7, 9, 11, 13, 17]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CATS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def one_resident_budget(model) -> int:
    return plan_for(model.hf_model, 1 << 40, NEEDS).with_resident(1).planned_bytes


def saved(model, folder: Path) -> Path:
    model.hf_model.save_pretrained(folder)
    return folder


def test_part_files_are_aligned_safetensors(tmp_path):
    from safetensors import safe_open

    tensors = {"b.weight": torch.randn(3, 5, dtype=torch.float64), "a": torch.arange(7, dtype=torch.int32),
               "h": torch.randn(4, dtype=torch.bfloat16)}
    path = tmp_path / "part.safetensors"
    size = write_part(path, tensors)
    assert size == path.stat().st_size
    header = read_header(path)
    assert header.data_start % STORE_ALIGNMENT == 0
    assert all(entry.begin % entry.dtype.itemsize == 0 for entry in header.entries.values())
    with safe_open(str(path), framework="pt") as handle:  # still a valid safetensors file
        for name, tensor in tensors.items():
            assert torch.equal(handle.get_tensor(name), tensor)
    for name, tensor in read_part(header).items():
        assert torch.equal(tensor, tensors[name])


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # untied and tied lm_head
def test_store_from_checkpoint_equals_store_from_model(tmp_path, family, cache):
    model = tiny_model(family)
    folder = saved(model, tmp_path / "model")
    loaded = load_model(folder, dtype="float64", memory_budget=one_resident_budget(model), memory_needs=NEEDS)
    from_checkpoint = loaded.weights.store.folder
    loaded.close()
    offload_model(model, one_resident_budget(model), NEEDS)
    from_memory = model.weights.store.folder
    model.close()
    assert from_checkpoint != from_memory  # keyed by their sources
    names = sorted(p.name for p in from_checkpoint.glob("*.safetensors"))
    assert names == sorted(p.name for p in from_memory.glob("*.safetensors"))
    assert ("lm_head.safetensors" in names) == (family == "llama")
    for name in names:
        assert (from_checkpoint / name).read_bytes() == (from_memory / name).read_bytes(), name


def test_truncated_layer_file_is_refused_or_rebuilt(tmp_path, cache, capsys):
    model = tiny_model("llama")
    folder = saved(model, tmp_path / "model")
    budget = one_resident_budget(model)
    first = load_model(folder, dtype="float64", memory_budget=budget, memory_needs=NEEDS)
    store = first.weights.store.folder
    first.close()
    layer = store / "layer-002.safetensors"
    layer.write_bytes(layer.read_bytes()[:-100])
    explicit = tmp_path / "explicit"
    shutil.copytree(store, explicit)
    with pytest.raises(StoreError, match=r"layer-002.safetensors has \d+ bytes, not \d+ \(truncated"):
        load_model(folder, dtype="float64", memory_budget=budget, memory_needs=NEEDS, layer_store=explicit)
    capsys.readouterr()
    again = load_model(folder, dtype="float64", memory_budget=budget, memory_needs=NEEDS)  # the default store is rebuilt
    assert "cats: rebuilding the layer store: layer file" in capsys.readouterr().err
    out = Generator(again).generate(PROMPT, GenerationConfig(max_new_tokens=8))
    assert out.token_ids == hf_greedy(model, PROMPT, 8)
    again.close()


def test_layer_truncated_while_streaming_is_an_error_not_wrong_output(tmp_path, cache):
    model = tiny_model("llama")
    offload_model(model, one_resident_budget(model), NEEDS)
    Generator(model).generate(PROMPT, GenerationConfig(max_new_tokens=4))
    layer = model.weights.store.folder / "layer-003.safetensors"
    layer.write_bytes(layer.read_bytes()[:5000])
    with pytest.raises(StoreError, match="layer-003.safetensors is truncated"):
        Generator(model).generate(PROMPT, GenerationConfig(max_new_tokens=20))
    model.close()


def test_store_of_another_model_is_refused(tmp_path, cache):
    first, second = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    explicit = tmp_path / "store"
    offload_model(first, one_resident_budget(first), NEEDS, layer_store=explicit)
    first.close()
    with pytest.raises(StoreError, match="was made from another model"):
        offload_model(second, one_resident_budget(second), NEEDS, layer_store=explicit)
    # a store whose record was edited to claim the second model still holds the first one's lm_head
    meta = json.loads((explicit / "store.json").read_text())
    from cats.model.identity import model_fingerprint

    meta.pop("crc32")
    meta["fingerprint"] = model_fingerprint(second)
    write_json(explicit / "store.json", meta)  # with a valid checksum
    with pytest.raises(StoreError, match="holds the lm_head of another model"):
        offload_model(second, one_resident_budget(second), NEEDS, layer_store=explicit)
    with pytest.raises(StoreError, match="exists and is not a layer store"):
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "x").write_text("x")
        offload_model(second, one_resident_budget(second), NEEDS, layer_store=tmp_path / "other")


def test_no_free_disk_is_a_clear_error(tmp_path, cache, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * 2**30, 10 * 2**30 - 1000, 1000))
    model = tiny_model("llama")
    with pytest.raises(StoreError, match=r"no room for the layer store: it needs .* only 1000.0 B|no room"):
        offload_model(model, one_resident_budget(model), NEEDS)
    assert not list((cache / "layers").glob("*")), "nothing half-written is left behind"
    assert all(p.device.type == "cpu" for p in model.hf_model.parameters()), "the model is untouched"


def test_budget_below_minimum_reads_nothing(tmp_path, cache):
    model = tiny_model("llama")
    folder = saved(model, tmp_path / "model")
    with pytest.raises(InvalidArgumentError, match="below the minimum of"):
        load_model(folder, dtype="float64", memory_budget="10%", memory_needs=NEEDS)
    assert not (cache / "layers").exists()
