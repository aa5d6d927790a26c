"""`cats bench` end to end on the tiny stories260K model: the files it writes, their schemas, bad input, a method
that crashes on one question, and an interrupted run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cats.cli import main
from cats.paths import cache_root

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
TINY = SHARED / "data" / "stories260k-gguf" / "hf"
SPEC_BENCH = SHARED / "data" / "spec_bench" / "question.jsonl"
METHODS = "ar,hf-ar,hf-pld,hf-early-exit,pld,early-exit"
BASE_ARGS = ["--model", str(TINY), "--questions", str(SPEC_BENCH), "--limit", "2", "--max-new-tokens", "16",
             "--prompt-format", "raw", "--threads", "1", "--no-progress"]

pytestmark = pytest.mark.skipif(not TINY.is_dir(), reason="../shared/data is not available")


def shared_kernels(cache: Path) -> None:
    """Make ``cache`` a CATS cache whose compiled kernels are this machine's usual ones (a link): a test of a first
    use elsewhere then does not spend ~7 s compiling them."""
    kernels = cache_root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "kernels").symlink_to(kernels, target_is_directory=True)


def cats_command() -> list[str]:
    script = Path(sys.executable).with_name("cats")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "cats.cli"]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    command = cats_command() + ["bench", *BASE_ARGS, "--methods", METHODS + ",llama-cpp", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    return out, done


def test_cli_run_writes_every_file(bench_run):
    out, done = bench_run
    assert done.returncode == 0, done.stderr
    names = {p.name for p in out.iterdir()}
    assert {f"{m}.jsonl" for m in METHODS.split(",")} <= names
    assert {"summary.json", "report.md", "speedup_per_category.png", "accept_length_histogram.png"} <= names
    assert not [n for n in names if n.endswith(".partial") or n.endswith(".tmp")]


def test_answer_file_schema(bench_run):
    out, _ = bench_run
    for method in METHODS.split(","):
        answers = [json.loads(line) for line in (out / f"{method}.jsonl").read_text().splitlines()]
        assert [a["question_id"] for a in answers] == [81, 82]  # file order, --limit 2
        for a in answers:
            assert {"question_id", "category", "model_id", "choices", "error", "tstamp"} <= set(a)
            assert a["error"] is None and a["method"] == method
            c = a["choices"][0]
            assert {"turns", "token_ids", "new_tokens", "wall_time", "accept_lengths", "decoding_steps"} <= set(c)
            assert len(c["turns"]) == len(c["token_ids"]) == len(c["new_tokens"]) == len(c["wall_time"]) == 1
            assert c["new_tokens"] == [len(c["token_ids"][0])] and 0 < c["new_tokens"][0] <= 16
            assert c["wall_time"][0] > 0 and all(n >= 1 for n in c["accept_lengths"])


def test_summary_schema(bench_run):
    out, _ = bench_run
    summary = json.loads((out / "summary.json").read_text())
    assert {"model", "dtype", "threads", "questions", "max_new_tokens", "methods"} <= set(summary)
    assert summary["questions"] == 2 and summary["max_new_tokens"] == 16 and summary["threads"] == 1
    assert summary["baseline"] in ("ar", "hf-ar") and summary["acceptance"] == "exact"
    assert set(summary["methods"]) == set(METHODS.split(","))
    # skipped either way: llama-cpp-python is not installed, or this HF folder is not a GGUF model
    assert summary["skipped"]["llama-cpp"]
    for name, m in summary["methods"].items():
        for key in ("tokens_per_s", "speedup", "mean_accepted", "new_tokens", "wall_s", "peak_rss_mb",
                    "exact_match", "per_category", "speedup_aggregate", "failures"):
            assert m[key] is not None, (name, key)
        assert m["exact_match"] == 1.0, name  # float32: every method is lossless
        assert m["failures"] == 0 and m["peak_rss_mb"] > 0
        assert set(m["per_category"]) == {"writing"}
        assert set(m["per_category"]["writing"]) >= {"speedup", "tokens_per_s", "mean_accepted"}
    assert summary["methods"][summary["baseline"]]["speedup"] == 1.0
    report = (out / "report.md").read_text()
    assert "## writing" in report and "greedy" in report and "`llama-cpp` was skipped" in report


def test_equal_command_on_a_run(bench_run):
    out, _ = bench_run
    assert main(["bench", "equal", str(out / "ar.jsonl"), str(out / "pld.jsonl")]) == 0


def error_line(args, capsys) -> str:
    assert main(["bench", *args]) == 2
    return capsys.readouterr().err.strip()


def test_bad_input_is_one_line(tmp_path, capsys):
    out = ["--out", str(tmp_path / "out")]
    assert "does not exist" in error_line(["--questions", str(tmp_path / "none.jsonl"), *out], capsys)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["a"]}\n{"question_id": 2}\n')
    assert "bad.jsonl, line 2: missing 'turns'" in error_line(["--questions", str(bad), *out], capsys)
    assert "selection is empty" in error_line(["--questions", str(SPEC_BENCH), "--limit", "0", *out], capsys)
    assert "unknown method 'nope'; known methods: ar" in error_line(
        ["--questions", str(SPEC_BENCH), "--methods", "ar,nope", *out], capsys)
    assert "temperature must be a number >= 0" in error_line(
        ["--questions", str(SPEC_BENCH), "--temperature", "-0.7", *out], capsys)
    assert "needs --out" in error_line(["--questions", str(SPEC_BENCH)], capsys)
    blocker = tmp_path / "file"
    blocker.write_text("")
    message = error_line(["--questions", str(SPEC_BENCH), "--out", str(blocker / "sub")], capsys)
    assert message.startswith("cats: error: --out") and "is not writable" in message
    assert "\n" not in message


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root can write to read-only folders")
def test_read_only_out(tmp_path, capsys):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        assert "is not writable" in error_line(["--questions", str(SPEC_BENCH), "--out", str(read_only)], capsys)
    finally:
        read_only.chmod(0o700)


def test_chat_format_needs_a_chat_template(tmp_path, capsys):
    args = ["--model", str(TINY), "--questions", str(SPEC_BENCH), "--limit", "1", "--methods", "ar",
            "--out", str(tmp_path)]  # the default prompt format is chat
    assert "has no chat template; pass --prompt-format raw" in error_line(args, capsys)


@pytest.fixture
def one_thread():
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_crash_on_one_question_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch, one_thread):
    from cats.bench import methods

    real_generate, pld_calls = methods.CatsMethod.generate, []

    def fragile_generate(self, prompt_ids, max_new_tokens, seed=None):
        if self.name == "pld":
            pld_calls.append(prompt_ids)
            if len(pld_calls) == 3:  # warm-up, question 81, then question 82 crashes
                raise RuntimeError("drafter exploded")
        return real_generate(self, prompt_ids, max_new_tokens, seed)

    monkeypatch.setattr(methods.CatsMethod, "generate", fragile_generate)
    out = tmp_path / "out"
    assert main(["bench", *BASE_ARGS, "--methods", "ar,pld", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    pld = summary["methods"]["pld"]
    assert pld["failures"] == 1 and pld["errors"] == {"82": "RuntimeError: drafter exploded"}
    assert pld["exact_match"] == 0.5 and summary["methods"]["ar"]["failures"] == 0
    answers = [json.loads(line) for line in (out / "pld.jsonl").read_text().splitlines()]
    assert [a["error"] for a in answers] == [None, "RuntimeError: drafter exploded"]
    assert "failed on 1 question" in (out / "report.md").read_text()


def test_an_interrupted_run_leaves_nothing_that_looks_complete(tmp_path, monkeypatch, one_thread):
    from cats.bench import methods

    out = tmp_path / "out"
    out.mkdir()
    (out / "ar.jsonl").write_text("stale\n")  # from an earlier run
    (out / "summary.json").write_text("{}")
    real_generate, calls = methods.CatsMethod.generate, []

    def interrupted_generate(self, prompt_ids, max_new_tokens, seed=None):
        calls.append(self.name)
        if len(calls) == 3:  # warm-up, question 81, then Ctrl-C during question 82
            raise KeyboardInterrupt
        return real_generate(self, prompt_ids, max_new_tokens, seed)

    monkeypatch.setattr(methods.CatsMethod, "generate", interrupted_generate)
    assert main(["bench", *BASE_ARGS, "--methods", "ar", "--out", str(out)]) == 130
    names = {p.name for p in out.iterdir()}
    assert names == {"ar.jsonl.partial"}
    assert len((out / "ar.jsonl.partial").read_text().splitlines()) == 1


def test_all_turns_each_method_continues_its_own_answer(tmp_path, one_thread):
    out = tmp_path / "out"
    mt_bench = SHARED / "data" / "mt_bench" / "question.jsonl"
    args = ["--model", str(TINY), "--questions", str(mt_bench), "--limit", "1", "--max-new-tokens", "8",
            "--prompt-format", "raw", "--threads", "1", "--no-progress", "--turns", "all", "--warmup", "0"]
    assert main(["bench", *args, "--methods", "ar,hf-ar", "--out", str(out)]) == 0
    answer = json.loads((out / "ar.jsonl").read_text())
    assert len(answer["choices"][0]["token_ids"]) == 2 and len(answer["choices"][0]["wall_time"]) == 2
    assert main(["bench", "equal", str(out / "ar.jsonl"), str(out / "hf-ar.jsonl")]) == 0


def test_cats_methods_with_adapters_report_the_cascade(tmp_path):
    import cats
    from cats.model.adapter import new_adapter

    model = cats.load_model(TINY)
    new_adapter(model, "draft", 1, vocab_subset=list(range(256))).save(tmp_path / "adapters" / "draft")
    new_adapter(model, "shallow", 3).save(tmp_path / "adapters" / "shallow")
    out = tmp_path / "out"
    command = cats_command() + ["bench", *BASE_ARGS, "--methods", "ar,tree,cats,cats-no-shallow", "--adapters",
                                str(tmp_path / "adapters"), "--sv-threshold", "0.02", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    methods = summary["methods"]
    assert all(methods[m]["exact_match"] == 1.0 for m in ("tree", "cats", "cats-no-shallow"))
    shallow = methods["cats"]["shallow"]
    assert shallow["nodes_drafted"] > 0 and 0 <= shallow["keep_rate"] <= 1
    assert "shallow" not in methods["cats-no-shallow"] and "shallow" not in methods["tree"]
    assert methods["cats"]["settings"]["cascade"]["sv_threshold"] == 0.02


def test_no_progress_also_silences_a_first_use_calibration(tmp_path):
    """--no-progress: no bar at all, not even the skip-set calibration that layer-skip runs on first use (an empty
    cache: it calibrates); without the flag the calibration says what it does."""
    environment = dict(os.environ, CATS_CACHE=str(tmp_path / "cache"))
    for cache in ("cache", "cache-2"):  # empty but for the compiled kernels (compiling them is not what is tested)
        shared_kernels(tmp_path / cache)
    args = [*BASE_ARGS[:-1], "--limit", "1", "--max-new-tokens", "4", "--warmup", "0", "--methods", "ar,layer-skip"]
    quiet = subprocess.run(cats_command() + ["bench", *args, "--no-progress", "--out", str(tmp_path / "quiet")],
                           capture_output=True, text=True, timeout=300, env=environment)
    assert quiet.returncode == 0, quiet.stderr
    assert "calibrat" not in quiet.stderr and "set/s" not in quiet.stderr
    environment["CATS_CACHE"] = str(tmp_path / "cache-2")
    loud = subprocess.run(cats_command() + ["bench", *args, "--out", str(tmp_path / "loud")],
                          capture_output=True, text=True, timeout=300, env=environment)
    assert loud.returncode == 0, loud.stderr
    assert "calibrating" in loud.stderr
