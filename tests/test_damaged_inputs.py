"""Damaged model and adapter files: every one is a `CatsError` naming the file, the fault and the fix (the command
line prints it on one line, exit status 2), never a traceback from a parser below; and random damage (random bytes,
truncations, bit flips) to a GGUF file, a safetensors checkpoint and an adapter either fails that way or loads
exactly the weights the file holds."""

from __future__ import annotations

import mmap
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import cats
import cats.cli
from cats.cli import main
from cats.errors import CatsError, DamagedFileError, NoTokenizerError
from cats.method_needs import HeldAs, adapter_bytes
from cats.model import load_model
from cats.model.adapter import (
    AdapterError,
    find_draft_adapter,
    load_adapter,
    new_adapter,
)
from cats.model.files import check_gguf, check_safetensors, gguf_tensors
from tests.conftest import STORIES_GGUF, STORIES_HF, needs, tiny_model

GGUF_SIZE = 1185376  # bytes of stories260K.gguf


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CATS_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def gguf(tmp_path) -> Path:
    path = tmp_path / "stories.gguf"
    shutil.copyfile(STORIES_GGUF, path)
    return path


def cli(capsys, *argv: str) -> tuple[int, str]:
    status = main(list(argv))
    return status, capsys.readouterr().err


def generate(capsys, model, *extra: str) -> tuple[int, str]:
    return cli(capsys, "generate", "--model", str(model), "--prompt", "Once", "--max-new-tokens", "2", *extra)


def one_line_error(err: str) -> str:
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("cats: error:")]
    assert len(lines) == 1, err
    return lines[0]


# ---------------------------------------------------------------------------------------------------------- GGUF
@needs(STORIES_GGUF)
def test_a_truncated_gguf_names_the_byte_it_ends_at(gguf, capsys):
    gguf.write_bytes(gguf.read_bytes()[:600_000])
    status, err = generate(capsys, gguf)
    assert status == 2
    line = one_line_error(err)
    assert str(gguf) in line and f"truncated at byte 600000 of {GGUF_SIZE}" in line and "re-download it" in line
    with pytest.raises(DamagedFileError, match="truncated at byte 600000"):
        load_model(gguf)


@needs(STORIES_GGUF)
def test_a_gguf_truncated_inside_its_header(gguf):
    gguf.write_bytes(gguf.read_bytes()[:1000])
    with pytest.raises(DamagedFileError, match="damaged or truncated header"):
        load_model(gguf)


def test_an_empty_gguf(tmp_path, capsys):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    status, err = generate(capsys, path)
    assert status == 2 and f"{path} is empty (0 bytes); re-download it" in one_line_error(err)


def test_a_gguf_of_random_bytes(tmp_path, capsys):
    path = tmp_path / "random.gguf"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    status, err = generate(capsys, path)
    assert status == 2 and "is not a GGUF file (starts with b'\\x89PNG" in one_line_error(err)
    with pytest.raises(DamagedFileError, match="not a GGUF file"):
        load_model(path)


@needs(STORIES_GGUF)
def test_a_gguf_without_a_tokenizer_says_what_to_use_on_the_command_line(gguf, capsys):
    status, err = generate(capsys, gguf)
    assert status == 2
    line = one_line_error(err)
    assert "has no tokenizer CATS can read" in line and "tokenizer files" in line and "GGUF file" in line
    assert "token ids" not in line
    model = load_model(gguf)  # the Python API takes token ids instead
    with pytest.raises(NoTokenizerError, match="pass token ids"):
        cats.generate(model, "Once")
    assert len(cats.generate(model, [1, 403], generation=cats.GenerationConfig(max_new_tokens=2)).token_ids) == 2


# --------------------------------------------------------------------------------------------------- checkpoints
@pytest.fixture
def checkpoint(tmp_path) -> Path:
    folder = tmp_path / "tiny"
    tiny_model("llama").hf_model.save_pretrained(folder)
    return folder


def test_a_folder_with_a_config_but_no_weights(checkpoint, capsys):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(DamagedFileError, match=r"has a config.json but no weights .*; copy the model's weight files"):
        load_model(checkpoint)
    status, err = generate(capsys, checkpoint)
    assert status == 2 and f"{checkpoint} has a config.json but no weights" in one_line_error(err)


def test_a_truncated_checkpoint(checkpoint, capsys):
    weights = checkpoint / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size - 100])
    with pytest.raises(DamagedFileError, match=f"model.safetensors is truncated at byte {size - 100} of {size}; re-down"):
        load_model(checkpoint)
    status, err = generate(capsys, checkpoint)
    assert status == 2 and f"{weights} is truncated at byte {size - 100} of {size}" in one_line_error(err)


def test_a_checkpoint_with_a_damaged_header(checkpoint):
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:12] = b"\x00\xff\x00\xff"  # the JSON header's first bytes
    weights.write_bytes(bytes(data))
    with pytest.raises(DamagedFileError, match="has a damaged header"):
        load_model(checkpoint)


def test_a_checkpoint_missing_a_tensor_names_it(checkpoint):
    weights = checkpoint / "model.safetensors"
    state = load_file(weights)
    del state["model.layers.2.mlp.up_proj.weight"]
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(DamagedFileError, match=r"lacks tensor model.layers.2.mlp.up_proj.weight that its config"):
        load_model(checkpoint)


def test_a_checkpoint_with_a_tensor_of_another_shape(checkpoint):
    weights = checkpoint / "model.safetensors"
    state = load_file(weights)
    state["model.norm.weight"] = torch.ones(65, dtype=torch.float64)
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(DamagedFileError, match="could not be loaded by transformers|wrong shape"):
        load_model(checkpoint)


# ------------------------------------------------------------------------------------------------------ adapters
@pytest.fixture
def adapter_folder(checkpoint, tmp_path) -> Path:
    model = load_model(checkpoint)
    return new_adapter(model, "draft", 1).save(tmp_path / "adapters" / "draft")


def test_a_truncated_adapter(checkpoint, adapter_folder):
    weights = adapter_folder / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:size // 2])
    model = load_model(checkpoint)
    with pytest.raises(DamagedFileError, match=f"truncated at byte {size // 2} of {size}; train it again"):
        load_adapter(find_draft_adapter(adapter_folder.parent), model)
    with pytest.raises(DamagedFileError, match=f"{weights} is truncated"):
        adapter_bytes(adapter_folder, HeldAs(4))  # the memory plan reads the adapter's header too


def test_an_adapter_with_a_damaged_config(checkpoint, adapter_folder):
    (adapter_folder / "config.json").write_bytes(b'{"role": "draft", "layer": \xff')
    with pytest.raises(AdapterError, match="config.json is not a CATS adapter config"):
        load_adapter(adapter_folder, load_model(checkpoint))


@needs(STORIES_HF)
def test_a_truncated_adapter_on_the_command_line(tmp_path, capsys):
    folder = tmp_path / "stories"
    shutil.copytree(STORIES_HF, folder)
    adapter = new_adapter(load_model(folder), "draft", 1).save(tmp_path / "adapters" / "draft")
    weights = adapter / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5])
    status, err = generate(capsys, folder, "--method", "early-exit", "--adapters", str(tmp_path / "adapters"))
    assert status == 2 and f"{weights} is truncated at byte 5 of at least 8" in one_line_error(err)


# ----------------------------------------------------------------------------------------------- command line
def test_an_internal_error_is_one_line_with_status_1_and_debug_shows_the_traceback(checkpoint, capsys, monkeypatch):
    def broken(threads):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(cats.cli, "set_threads", broken)
    status, err = generate(capsys, checkpoint, "--threads", "1")
    assert status == 1 and "Traceback" not in err
    assert err.strip() == "cats: error: RuntimeError: boom ... (run with --debug for the traceback)"
    status, err = cli(capsys, "--debug", "generate", "--model", str(checkpoint), "--prompt", "x", "--threads", "1")
    assert status == 1 and "Traceback (most recent call last)" in err and "RuntimeError: boom" in err


def test_debug_shows_the_traceback_of_a_user_error_too(tmp_path, capsys):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    status, err = cli(capsys, "--debug", "generate", "--model", str(path), "--prompt", "x")
    assert status == 2 and "Traceback" in err and err.rstrip().endswith("is empty (0 bytes); re-download it")


def test_an_interrupt_exits_130(capsys, monkeypatch):
    def interrupted(threads):
        raise KeyboardInterrupt

    monkeypatch.setattr(cats.cli, "set_threads", interrupted)
    status, err = cli(capsys, "generate", "--prompt", "x", "--threads", "1")
    assert status == 130 and err.strip() == "cats: interrupted"


# ------------------------------------------------------------------------------------------------ random damage
def damage():
    """Random bytes of a random length; a truncation at a random offset; or 1-3 bit flips."""
    return st.one_of(
        st.tuples(st.just("bytes"), st.binary(max_size=4096)),
        st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True)),
        st.tuples(st.just("flip"), st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)),
                                            min_size=1, max_size=3)),
    )


def damaged(original: bytes, how) -> bytes:
    kind, what = how
    if kind == "bytes":
        return what
    if kind == "truncate":
        return original[:int(what * len(original))]
    data = bytearray(original)
    for where, bit in what:
        data[int(where * len(data))] ^= 1 << bit
    return bytes(data)


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def expect_clear_error_or_the_files_weights(load, path: Path, original: bytes, how, weights_of, data_start: int):
    """Damage ``path``, load: a CatsError, or a load whose weights are the original's, or differ only where the
    damage changed the tensor bytes (past ``data_start``, the header untouched)."""
    reference = weights_of(load())
    data = damaged(original, how)
    path.write_bytes(data)
    try:
        loaded = load()
    except CatsError:
        return
    finally:
        path.write_bytes(original)
    if not same_state(weights_of(loaded), reference):
        assert len(data) == len(original) and data[:data_start] == original[:data_start], how
        assert data[data_start:] != original[data_start:], how


FAST = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@needs(STORIES_GGUF)
@FAST
@given(how=damage())
def test_random_damage_to_a_gguf(tmp_path_factory, how):
    folder = tmp_path_factory.mktemp("gguf")
    path = folder / "stories.gguf"
    original = STORIES_GGUF.read_bytes()
    path.write_bytes(original)
    start = data_start_of_gguf(path)

    def weights(model):
        return {k: v.clone() for k, v in model.hf_model.state_dict().items()}

    expect_clear_error_or_the_files_weights(lambda: load_model(path), path, original, how, weights, start)


def data_start_of_gguf(path: Path) -> int:
    check_gguf(path)
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return min(begin for _name, begin, _n in gguf_tensors(data))


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-checkpoint")
    tiny_model("llama").hf_model.save_pretrained(folder)
    return folder


def safetensors_data_start(path: Path) -> int:
    check_safetensors(path)
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


@FAST
@given(how=damage())
def test_random_damage_to_a_checkpoint(saved_tiny, how):
    weights_file = saved_tiny / "model.safetensors"
    original = weights_file.read_bytes()

    def weights(model):
        return {k: v.clone() for k, v in model.hf_model.state_dict().items()}

    expect_clear_error_or_the_files_weights(lambda: load_model(saved_tiny, dtype="float64"), weights_file, original,
                                            how, weights, safetensors_data_start(weights_file))


@pytest.fixture(scope="module")
def saved_adapter(saved_tiny, tmp_path_factory):
    model = load_model(saved_tiny, dtype="float64")
    return model, new_adapter(model, "draft", 1).save(tmp_path_factory.mktemp("adapter") / "draft")


@FAST
@given(how=damage(), config=st.booleans())
def test_random_damage_to_an_adapter(saved_adapter, how, config):
    model, folder = saved_adapter
    path = folder / ("config.json" if config else "model.safetensors")
    original = path.read_bytes()
    start = len(original) if config else safetensors_data_start(path)

    def weights(adapter):
        return {k: v.clone() for k, v in adapter.state_dict().items()}

    expect_clear_error_or_the_files_weights(lambda: load_adapter(folder, model), path, original, how, weights, start)
