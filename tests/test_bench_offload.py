"""`cats bench --memory-budget`: every method in its own worker process under the same budget, the hf-offload
baseline (transformers + accelerate offloading), and the memory fields of summary.json and report.md."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cats.bench.catalog import make_method
from cats.bench.methods import BenchContext, MethodSettings, MethodUnavailableError
from cats.bench.report import render_report
from cats.bench.summary import offload_totals, summarize, within_budget
from cats.model.weights.budget import LIBRARY_PAGES
from tests.conftest import SMOLLM2, needs, tiny_config

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT.parent / "shared" / "data" / "stories260k-gguf" / "hf"
SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CATS_CACHE", str(tmp_path / "cache"))


def eight_layer_model(folder: Path, with_tokenizer: bool) -> Path:
    """A random 8-layer Llama saved in float32 (the stories260K tokenizer's 512-token vocabulary when asked)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("llama")
    config.num_hidden_layers, config.intermediate_size, config.vocab_size = 8, 256, 512
    config.eos_token_id = None  # random weights: do not stop early
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    if with_tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(STORIES / name, folder / name)
    return folder


def answer(question_id, offload=None):
    choice = {"turns": ["x"], "token_ids": [[1, 2]], "new_tokens": [2], "wall_time": [1.0], "accept_lengths": [1],
              "decoding_steps": [2]}
    if offload is not None:
        choice["offload"] = offload
    return {"question_id": question_id, "category": "c", "choices": [choice], "error": None}


def turn(read_s, stall_s, decode_s=None):
    counts = {"bytes_read": 100, "layers_read": 4, "read_s": read_s, "stall_s": stall_s, "stalls": 1, "acquires": 4,
              "out_of_order": 0, "streamed_layers": [2, 3, 4, 5], "io": "direct"}
    return counts if decode_s is None else {**counts, "decode_s": decode_s}  # answers before block stores lack it


def test_offload_totals_and_the_budget_bound():
    answers = [answer(1, [turn(1.0, 0.25)]), answer(2, [turn(3.0, 0.25, decode_s=1.5)])]
    totals = offload_totals(answers)
    assert totals["bytes_read"] == 200 and totals["read_s"] == 4.0 and totals["stall_s"] == 0.5
    assert totals["decode_s"] == 1.5
    assert totals["hidden_fraction"] == 0.875 and totals["streamed_layers"] == [2, 3, 4, 5]
    assert offload_totals([answer(1)]) is None
    assert within_budget(500.0, 100.0, 400.0) and not within_budget(511.0, 100.0, 400.0)
    assert within_budget(None, 100.0, 400.0) is None
    run = {"model": "m", "dtype": "float32", "threads": 1, "questions": 2, "max_new_tokens": 2,
           "memory_budget": "50%", "memory_budget_mb": 100.0, "runtime_baseline_mb": 400.0}
    summary = summarize({"ar": answers}, run, peak_rss_mb={"ar": 505.0},
                        memory={"ar": {"plan": None, "storage_read_mb": 1.0, "page_cache_mb": 0.0}})
    entry = summary["methods"]["ar"]
    assert entry["within_budget"] is True and entry["offload"]["hidden_fraction"] == 0.875
    assert entry["memory"]["storage_read_mb"] == 1.0
    report = render_report(summary)
    assert "## Memory and streaming" in report and "| ar | 505 | True | [2, 6) | 0 | 4.0 | 1.5 | 0.5 | 88% |" in report
    assert "memory budget: 50% = 100.0 MiB; runtime baseline 400.0 MiB" in report


def test_hf_offload_needs_a_budget_and_matches_greedy(tmp_path):
    import cats

    folder = eight_layer_model(tmp_path / "model", with_tokenizer=False)
    with pytest.raises(MethodUnavailableError, match="pass --memory-budget"):
        make_method("hf-offload", BenchContext(None, str(folder)))
    budgeted = BenchContext(None, str(folder), MethodSettings(), memory_budget="60%", context_tokens=64)
    with pytest.raises(MethodUnavailableError, match="cannot run under --memory-budget"):
        make_method("hf-ar", budgeted)
    method = make_method("hf-offload", budgeted)
    try:
        info = method.describe()
        assert info["modules_placed"].get("disk"), info  # part of the model really is offloaded
        reference = make_method("ar", BenchContext(cats.load_model(str(folder)), str(folder)))
        prompt = [5, 7, 9, 11, 13, 17]
        assert method.generate(prompt, 12).token_ids == reference.generate(prompt, 12).token_ids
    finally:
        method.close()


@pytest.mark.skipif(not STORIES.is_dir() or not SPEC_BENCH.is_file(), reason="../shared/data is not available")
def test_worker_answers_under_the_budget(tmp_path):
    """What one worker process does, run here: load under the budget, answer, measure."""
    from cats.bench.answers import PARTIAL_SUFFIX, read_answers
    from cats.bench.worker import run_job
    from cats.prompts import read_questions

    folder = eight_layer_model(tmp_path / "model", with_tokenizer=True)
    question = read_questions(SPEC_BENCH)[0]
    job = {"model": str(folder), "method": "ar", "dtype": "float32", "kernels": "auto", "threads": 1, "settings": {},
           "memory_budget": "150%", "prefetch": 2, "offload_io": "direct", "context_tokens": 112,
           "questions": [{"question_id": question.question_id, "category": question.category,
                          "turns": list(question.turns)}],
           "question_file": str(SPEC_BENCH), "turns": "first", "prompt_format": "raw", "max_new_tokens": 6,
           "warmup": 0, "model_id": "m", "answers": str(tmp_path / "ar.jsonl"), "result": str(tmp_path / "r.json")}
    result = run_job(job)
    assert "skipped" not in result, result
    assert result["plan"]["streamed_layers"] == list(range(result["plan"]["resident_layers"], 8))
    assert result["plan"]["resident_layers"] < 8 and result["page_cache_mb"] == 0.0
    assert result["peak_rss_mb"] > 0 and result["settings"]["streamed_layers"][-1] == 7
    answers = read_answers(tmp_path / f"ar.jsonl{PARTIAL_SUFFIX}")  # the parent renames it when the run is done
    assert answers[0]["error"] is None and answers[0]["choices"][0]["new_tokens"] == [6]
    assert answers[0]["choices"][0]["offload"][0]["acquires"] > 0
    # a method plans for the settings it takes: dytc-free never reads the --adapters the run was given
    free = {**job, "method": "dytc-free", "settings": {"adapters": str(tmp_path / "adapters-it-never-reads")},
            "answers": str(tmp_path / "dytc-free.jsonl")}
    result = run_job(free)
    assert "skipped" not in result, result
    assert result["plan"]["parts_mb"]["adapters"] == 0
    job["memory_budget"] = "1%"
    assert "below the minimum" in run_job(job)["skipped"]


@pytest.mark.slow  # five fresh processes (each imports torch and transformers)
@pytest.mark.skipif(not STORIES.is_dir() or not SPEC_BENCH.is_file(), reason="../shared/data is not available")
def test_budgeted_bench_runs_every_method_in_its_own_process(tmp_path):
    """The budget is each process's memory: the runtime each worker measured before loading weights is in its plan.
    (Whether layers stream is the planner's business, tested on its own: this model's 2 MB would drown in the
    runtime's noise.)"""
    folder = eight_layer_model(tmp_path / "model", with_tokenizer=True)
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "cats.cli", "bench", "--model", str(folder), "--questions", str(SPEC_BENCH),
               "--limit", "1", "--max-new-tokens", "8", "--prompt-format", "raw", "--threads", "1", "--warmup", "0",
               "--no-progress", "--methods", "ar,early-exit,hf-offload,hf-ar", "--draft-layer", "1",
               "-k", "3", "--memory-budget", "110%+2GiB", "--out", str(out)]
    environment = {**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    weights = 8 * 61568 * 4 + 2 * 512 * 64 * 4 + 64 * 4
    assert summary["memory_budget"] == "110%+2GiB"
    assert summary["memory_budget_mb"] == round((int(1.1 * weights) + (2 << 30)) / 2**20, 1)
    assert summary["runtime_baseline_mb"] > 50 and "own process" in summary["peak_rss_method"]
    assert set(summary["methods"]) == {"ar", "early-exit", "hf-offload"} and "hf-ar" in summary["skipped"]
    for name, method in summary["methods"].items():
        assert method["exact_match"] == 1.0, name
        assert method["peak_rss_mb"] > summary["runtime_baseline_mb"] * 0.5, name
        assert isinstance(method["within_budget"], bool) and "memory" in method, name
    for name in ("ar", "early-exit"):
        parts = summary["methods"][name]["memory"]["plan"]["parts_mb"]
        assert parts["runtime (measured before loading weights)"] > 50, name
    assert summary["methods"]["hf-offload"]["settings"]["max_memory_cpu_mb"] < 2048
    assert not list(out.glob("*.partial")) and (out / "ar.jsonl").is_file()
    assert "## Memory and streaming" in (out / "report.md").read_text()


@pytest.mark.slow  # three processes loading torch: ~40 s
@needs(SMOLLM2)
def test_a_budgeted_bench_streams_a_gguf_from_the_file_on_its_blocks(tmp_path):
    """A .gguf on its blocks under --memory-budget (the process's: the runtime's anonymous memory, as a fresh process
    measures it, and the page cache the plan keeps for the libraries' pages, then 60 % of the file's 92 MiB): no
    layer store is made; each worker streams from the file."""
    from cats.model.weights.rss import runtime_baseline

    out = tmp_path / "bench"
    runtime_mb = runtime_baseline(str(SMOLLM2), 1)["anonymous_mb"]  # what each worker plans for before the model
    command = [sys.executable, "-m", "cats.cli", "bench", "--model", str(SMOLLM2), "--questions", str(SPEC_BENCH),
               "--limit", "1", "--max-new-tokens", "6", "--threads", "1", "--warmup", "0", "--no-progress",
               "--methods", "ar,pld", "--memory-budget", f"60%+{int(runtime_mb) + (LIBRARY_PAGES >> 20)}MiB",
               "--out", str(out)]
    environment = {**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["methods"]) == {"ar", "pld"}
    for name, method in summary["methods"].items():
        assert method["exact_match"] == 1.0 and method["settings"]["weights"].startswith("GGUF"), name
        assert "gguf-blocks" in method["settings"]["weights"], name
        plan = method["memory"]["plan"]
        assert plan["streamed_layers"][0] < 30 and plan["coded_layers"] == 0, name
        assert method["offload"]["acquires"] > 0, name
    assert not (tmp_path / "cache" / "layers").exists()  # no layer store
