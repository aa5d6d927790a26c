"""Cached files are never silently wrong: the GGUF conversion, the layer store, the skip-set cache and the compiled
libraries each detect an overwritten, truncated or deleted file and make it again with a one-line notice on stderr,
and a killed run's staging entries are removed by the next one (a live process's are kept)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import cats
from cats import cache_files
from cats.config import GenerationConfig
from cats.draft.layer_skip import calibration as cal
from cats.loop.generator import Generator
from cats.model.kernels import native
from cats.model.load import load_model
from cats.model.weights import MemoryNeeds, StoreError, plan_for
from tests.conftest import STORIES_GGUF, VOCAB, hf_greedy, needs, tiny_model

NEEDS = MemoryNeeds(context_tokens=64, min_resident_layers=1, max_tree_tokens=17, prefetch=1)
PROMPT = [5, 7, 9, 11, 13, 17]
FAULTS = ["overwrite", "truncate", "delete"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CATS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def damage(path: Path, fault: str) -> None:
    """``overwrite``: bytes in the middle replaced, same size (the modification time moves, as any write moves it);
    ``truncate``: the second half cut off; ``delete``: the file removed."""
    if fault == "delete":
        path.unlink()
        return
    size = path.stat().st_size
    if fault == "truncate":
        os.truncate(path, size // 2)
        return
    with open(path, "r+b") as handle:
        handle.seek(size // 2)
        old = handle.read(64)
        handle.seek(size // 2)
        handle.write(bytes(b ^ 0xFF for b in old))
    status = path.stat()
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns + 1_000_000))  # filesystems with coarse timestamps


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def stale_and_live(folder: Path, name: str) -> tuple[Path, Path]:
    """A staging folder of a process that is gone and one of a live process (this one's parent), beside ``name``
    in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    stale, live = folder / f".{name}.tmp-{dead_pid()}-0123abcd", folder / f".{name}.tmp-{os.getppid()}-4567ef01"
    for path in (stale, live):
        path.mkdir()
        (path / "part").write_bytes(b"x" * 100)
    return stale, live


# --------------------------------------------------------------------------------------------- the shared mechanics
def test_checked_json_and_file_records(tmp_path):
    path = tmp_path / "a.json"
    cache_files.write_json(path, {"x": [1, 2.5, "y"]})
    assert cache_files.read_json(path) == {"x": [1, 2.5, "y"]}
    path.write_text(path.read_text().replace("2.5", "3.5"))
    with pytest.raises(cache_files.Damaged, match="does not match its checksum"):
        cache_files.read_json(path)
    path.write_text(json.dumps({"x": 1}))
    with pytest.raises(cache_files.Damaged, match="has no checksum"):
        cache_files.read_json(path)

    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(3 << 20))
    records = cache_files.describe_files(tmp_path, ["data.bin"])
    assert not cache_files.check_files(tmp_path, records)  # size and mtime match: trusted without reading
    os.utime(data, ns=(0, 12345))  # same content, another modification time: read, matches, record refreshed
    assert cache_files.check_files(tmp_path, records) and records["data.bin"]["mtime_ns"] == 12345
    damage(data, "overwrite")
    with pytest.raises(cache_files.Damaged, match="does not match its checksum"):
        cache_files.check_files(tmp_path, records)
    assert not list(tmp_path.glob(".*tmp-*")), "no staging file is left behind"


def test_staging_of_a_killed_process_is_removed_and_a_live_ones_kept(tmp_path):
    target = tmp_path / "model-0123456789abcdef"
    script = ("import importlib.util, os, sys\n"  # cats.cache_files alone (stdlib only), not the whole package
              "spec = importlib.util.spec_from_file_location('c', sys.argv[2])\n"
              "c = importlib.util.module_from_spec(spec); spec.loader.exec_module(c)\n"
              "with c.staging_folder(sys.argv[1]) as s:\n"
              "    (s / 'model.safetensors').write_bytes(b'x' * 4096)\n"
              "    os.kill(os.getpid(), 9)\n")
    killed = subprocess.run([sys.executable, "-c", script, str(target), cache_files.__file__])
    assert killed.returncode == -9
    left = [p for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].name.startswith(f".{target.name}.tmp-") and not target.exists()
    live = cache_files.staging_path(target)  # this process's own
    live.mkdir()
    reused = tmp_path / f".{target.name}.tmp-{os.getpid()}-89abcdef"  # a killed run that had this process's pid
    reused.mkdir()
    old = tmp_path / f"{target.name}.abc_1234"  # an older CATS version's staging folder (no pid), untouched a day
    old.mkdir()
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    recent = tmp_path / f"{target.name}.xyz_5678"
    recent.mkdir()
    cache_files.clean_stale(tmp_path, legacy=cats.model.source.LEGACY_CONVERSION_STAGING)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, recent.name])


# --------------------------------------------------------------------------------------------- GGUF conversion
@needs(STORIES_GGUF)
@pytest.mark.parametrize("fault", FAULTS)
def test_damaged_conversion_is_converted_again(cache, fault, capsys):
    with pytest.warns(UserWarning):
        first = cats.load_model(STORIES_GGUF, kernels="aten")
    ids = torch.tensor([1, 400, 30, 87, 5])
    with torch.no_grad():
        expected = first.forward(ids, first.new_cache())
    (folder,) = (cache / "gguf").iterdir()
    checkpoint = folder / "model.safetensors"
    stale, live = stale_and_live(cache / "gguf", folder.name)
    os.utime(folder / "config.json")  # touched, same content: trusted after one read, no conversion
    capsys.readouterr()
    with pytest.warns(UserWarning):
        cats.load_model(STORIES_GGUF, kernels="aten")
    assert "cats:" not in capsys.readouterr().err
    assert not stale.exists() and live.exists()

    damage(checkpoint, fault)
    with pytest.warns(UserWarning):
        again = cats.load_model(STORIES_GGUF, kernels="aten")
    err = capsys.readouterr().err
    notices = [line for line in err.splitlines() if line.startswith("cats: the converted checkpoint is damaged: ")]
    assert len(notices) == 1
    assert "model.safetensors" in notices[0] and "Traceback" not in err
    with torch.no_grad():
        assert torch.equal(again.forward(ids, again.new_cache()), expected)
    cats.model.source.verify_conversion(folder)  # the new conversion matches its record
    assert [p.name for p in (cache / "gguf").iterdir() if p.name != live.name] == [folder.name]


@needs(STORIES_GGUF)
def test_conversion_of_an_older_cats_without_records_is_converted_again(cache, capsys):
    with pytest.warns(UserWarning):
        cats.load_model(STORIES_GGUF, kernels="aten")
    (folder,) = (cache / "gguf").iterdir()
    (folder / "cats-source.json").write_text(json.dumps({"gguf": str(STORIES_GGUF.resolve())}))
    with pytest.warns(UserWarning):
        cats.load_model(STORIES_GGUF, kernels="aten")
    assert "has no checksum" in capsys.readouterr().err
    cats.model.source.verify_conversion(folder)


@needs(STORIES_GGUF)
def test_conversion_follows_its_gguf_file_when_moved(cache, tmp_path):
    """The conversion is keyed by the file's bytes; a copy elsewhere reuses it, and its record then names the copy
    (where the quantised blocks of a memory budget's layer store are read), not a path that may be gone."""
    moved = tmp_path / "moved" / STORIES_GGUF.name
    moved.parent.mkdir()
    shutil.copyfile(STORIES_GGUF, moved)
    with pytest.warns(UserWarning):
        cats.load_model(STORIES_GGUF, kernels="aten")
    (folder,) = (cache / "gguf").iterdir()
    assert cache_files.read_json(folder / "cats-source.json")["gguf"] == str(STORIES_GGUF.resolve())
    with pytest.warns(UserWarning):
        cats.load_model(moved, kernels="aten")
    assert [p.name for p in (cache / "gguf").iterdir()] == [folder.name]  # not converted again
    assert cache_files.read_json(folder / "cats-source.json")["gguf"] == str(moved.resolve())
    cats.model.source.verify_conversion(folder)


# --------------------------------------------------------------------------------------------- layer store
def budget_load(folder: Path, model, **kwargs):
    budget = plan_for(model.hf_model, 1 << 40, NEEDS).with_resident(1).planned_bytes
    return load_model(folder, dtype="float64", memory_budget=budget, memory_needs=NEEDS, **kwargs)


@pytest.mark.parametrize("fault", [*FAULTS, "store.json"])
def test_damaged_layer_store_is_rebuilt(tmp_path, cache, fault, capsys):
    model = tiny_model("llama")
    folder = tmp_path / "model"
    model.hf_model.save_pretrained(folder)
    expected = hf_greedy(model, PROMPT, 8)
    first = budget_load(folder, model)
    store = first.weights.store.folder
    first.close()
    meta = json.loads((store / "store.json").read_text())
    assert {"size", "mtime_ns", "crc32"} <= set(meta["parts"]["layer-002"]) and "crc32" in meta
    stale, live = stale_and_live(store.parent, store.name)
    damage(store / ("store.json" if fault == "store.json" else "layer-002.safetensors"),
           "overwrite" if fault == "store.json" else fault)
    capsys.readouterr()
    again = budget_load(folder, model)
    err = capsys.readouterr().err
    assert "cats: rebuilding the layer store: " in err and "Traceback" not in err
    assert ("store.json" if fault == "store.json" else "layer-002.safetensors") in err
    assert Generator(again).generate(PROMPT, GenerationConfig(max_new_tokens=8)).token_ids == expected
    again.close()
    assert not stale.exists() and live.exists()


def test_overwritten_layer_in_an_explicit_store_is_an_error(tmp_path, cache):
    model = tiny_model("llama")
    folder = tmp_path / "model"
    model.hf_model.save_pretrained(folder)
    explicit = tmp_path / "store"
    budget_load(folder, model, layer_store=explicit).close()
    os.utime(explicit / "layer-001.safetensors")  # touched only: still opens
    budget_load(folder, model, layer_store=explicit).close()
    damage(explicit / "layer-001.safetensors", "overwrite")
    with pytest.raises(StoreError, match=r"layer-001.safetensors does not match its checksum; delete .* to rebuild"):
        budget_load(folder, model, layer_store=explicit)


# --------------------------------------------------------------------------------------------- skip-set cache
@pytest.mark.parametrize("fault", ["overwrite", "truncate"])
def test_damaged_skip_set_file_is_calibrated_again(cache, fault, capsys):
    model = tiny_model("llama")
    prompts = [torch.randint(3, VOCAB, (10,), generator=torch.Generator().manual_seed(3)).tolist() for _ in range(3)]
    (first,) = cal.calibrate(model, [0.25], prompts=prompts, tokens=4, budget=3)
    path = cal.skip_set_file(model)
    stale, live = stale_and_live(path.parent, path.name)
    damage(path, fault)
    capsys.readouterr()
    assert cal.load_cached(model) == {}
    err = capsys.readouterr().err
    assert err.startswith("cats: the cached skip sets are damaged: ") and len(err.splitlines()) == 1
    assert not path.exists() and not stale.exists() and live.exists()
    (again,) = cal.calibrate(model, [0.25], prompts=prompts, tokens=4, budget=3)
    assert again.skip == first.skip and cal.load_cached(model)["0.25"].skip == first.skip


# --------------------------------------------------------------------------------------------- compiled libraries
def test_damaged_library_is_compiled_again(tmp_path, cache, capsys):
    if native.compiler() is None:
        pytest.skip("no C compiler")
    source = tmp_path / "answer.c"
    source.write_text("int answer(void) { return 42; }\n")
    flags = ("-O1", "-shared", "-fPIC")
    # built first in another process: this one must not have a library mapped while it is damaged
    script = ("import sys; from pathlib import Path; from cats.model.kernels import native\n"
              "for fault in sys.argv[2:]:\n"
              "    library, reason = native.build_library(Path(sys.argv[1]), ('-O1', '-shared', '-fPIC'), fault)\n"
              "    assert reason is None and library.answer() == 42, reason\n")
    subprocess.run([sys.executable, "-c", script, str(source), *FAULTS], cwd=Path(__file__).parents[1], check=True)
    for fault in FAULTS:
        (folder,) = (cache / "kernels").glob(f"{fault}-*")
        stale, live = stale_and_live(cache / "kernels", folder.name)
        damage(folder / f"{fault}.so", fault)
        capsys.readouterr()
        library, reason = native.build_library(source, flags, fault)
        err = capsys.readouterr().err
        assert reason is None and library.answer() == 42
        assert err.startswith("cats: the compiled library in ") and f"{fault}.so" in err.splitlines()[0]
        assert "compiling answer.c for this CPU" in err and "Traceback" not in err
        cache_files.check_folder(folder, native.RECORD)
        assert not stale.exists() and live.exists()
        native.build_library(source, flags, fault)
        assert capsys.readouterr().err == "", "a sound library is loaded without a word"
