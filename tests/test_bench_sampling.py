"""`cats bench --temperature T`: sampled runs of every method (speedup, mean accepted), per-turn seeds shared by the
methods, no token comparison; typical acceptance labelled lossy with its drift from greedy (prefix agreement)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from cats.bench.catalog import make_method
from cats.bench.methods import BenchContext, MethodSettings, SamplingSettings
from cats.bench.report import render_report
from cats.bench.summary import prefix_agreement, summarize
from cats.cli import main
from tests.conftest import SHARED_DATA, STORIES_GGUF, STORIES_HF, needs

QUESTIONS = SHARED_DATA / "spec_bench" / "question.jsonl"
ARGS = ["--model", str(STORIES_HF), "--questions", str(QUESTIONS), "--limit", "2", "--max-new-tokens", "12",
        "--prompt-format", "raw", "--threads", "1", "--no-progress", "--warmup", "0"]


def answer(qid, token_ids):
    return {"question_id": qid, "category": "c", "error": None,
            "choices": [{"turns": ["t"] * len(token_ids), "token_ids": token_ids,
                         "new_tokens": [len(t) for t in token_ids], "wall_time": [1.0] * len(token_ids),
                         "accept_lengths": [1]}]}


def test_prefix_agreement_by_hand():
    reference = [answer(1, [[1, 2, 3, 4]]), answer(2, [[5, 6], [7, 8]])]
    drifted = [answer(1, [[1, 2, 9, 4]]), answer(2, [[5, 6], [7, 8]])]
    assert prefix_agreement(drifted, reference) == pytest.approx((2 / 4 + 1) / 2)
    assert prefix_agreement(reference, reference) == 1.0


def test_sampled_summary_compares_no_tokens_and_says_so():
    answers = {"ar": [answer(1, [[1, 2]])], "pld": [answer(1, [[1, 3]])]}
    run = {"model": "m", "dtype": "float32", "threads": 1, "questions": 1, "max_new_tokens": 2, "temperature": 0.7,
           "top_p": 0.9, "top_k": 0, "seed": 4, "acceptance": "exact"}
    summary = summarize(answers, run)
    assert summary["exact_match_reference"] is None
    assert all(m["exact_match"] is None and m["prefix_agreement"] is None for m in summary["methods"].values())
    assert summary["methods"]["pld"]["speedup"] == 1.0 and summary["methods"]["pld"]["acceptance"] == "exact"
    report = render_report(summary)
    assert "**sampled** (temperature 0.7, top-p 0.9; per-turn seeds from base seed 4" in report


@needs(QUESTIONS)
@needs(STORIES_HF)
def test_bench_sampled_run(tmp_path, capsys):
    methods = "ar,hf-ar,pld,early-exit,tree"
    runs = []
    for number in range(2):
        out = tmp_path / f"out{number}"
        assert main(["bench", *ARGS, "--methods", methods, "--temperature", "0.8", "--top-k", "40", "--seed", "2",
                     "--out", str(out)]) == 0
        runs.append(out)
    printed = capsys.readouterr().out
    assert "acceptance: exact, temperature 0.8" in printed and "mean accepted" in printed
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert (summary["temperature"], summary["top_k"], summary["seed"], summary["acceptance"]) == (0.8, 40, 2, "exact")
    for name, method in summary["methods"].items():
        assert method["speedup"] is not None and method["mean_accepted"] is not None, name
        assert method["exact_match"] is None and method["acceptance"] == "exact", name
    for name in methods.split(","):  # the same seeds: a sampled run repeats token for token
        assert main(["bench", "equal", str(runs[0] / f"{name}.jsonl"), str(runs[1] / f"{name}.jsonl")]) == 0, name


@needs(QUESTIONS)
@needs(STORIES_HF)
def test_bench_typical_run_is_labelled_lossy(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", *ARGS, "--methods", "ar,pld,tree", "--acceptance", "typical", "--typical-tau", "0.2",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["acceptance"] == "typical (lossy)" and summary["typical_tau"] == 0.2
    assert summary["methods"]["ar"]["acceptance"] == "exact"  # nothing drafted, nothing to accept loosely
    assert summary["methods"]["pld"]["acceptance"] == summary["methods"]["tree"]["acceptance"] == "typical (lossy)"
    assert summary["methods"]["ar"]["prefix_agreement"] == 1.0  # greedy: the drift is measured against ar
    assert all(summary["methods"][m]["prefix_agreement"] is not None for m in ("pld", "tree"))
    assert "**typical (lossy)**" in (out / "report.md").read_text()
    assert "acceptance: typical (lossy)" in capsys.readouterr().out


@needs(STORIES_HF)
@pytest.mark.parametrize("args, message", [
    (["--seed", "1"], "seed applies to sampling, but temperature is 0"),
    (["--typical-alpha", "0.2"], "typical_alpha applies to typical acceptance only"),
    (["--temperature", "-0.5"], "temperature must be a number >= 0"),
])
def test_bench_bad_sampling_input(tmp_path, capsys, args, message):
    assert main(["bench", *ARGS, "--methods", "ar", *args, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything ran


@needs(STORIES_HF)
def test_baselines_sample_with_the_runs_settings(monkeypatch):
    import cats

    model = cats.load_model(str(STORIES_HF))
    sampled = MethodSettings(sampling=SamplingSettings(temperature=0.9, top_p=0.95, top_k=30))
    context = BenchContext(model, str(STORIES_HF), sampled)
    hf = make_method("hf-ar", context)
    assert hf.sampling_kwargs == dict(do_sample=True, temperature=0.9, top_p=0.95, top_k=30)
    prompt = model.tokenizer("Once upon a time")["input_ids"]
    first, again = hf.generate(prompt, 10, seed=5), hf.generate(prompt, 10, seed=5)
    assert first.token_ids == again.token_ids
    assert make_method("hf-ar", BenchContext(model, str(STORIES_HF))).sampling_kwargs == dict(do_sample=False)

    calls = []

    class FakeLlama:  # llama-cpp-python stand-in: records what the method asks for
        def __init__(self, model_path, **kwargs):
            pass

        def reset(self):
            pass

        def eval(self, tokens):
            pass

        def set_seed(self, seed):
            calls.append(("seed", seed))

        def generate(self, tokens, **kwargs):
            calls.append(("generate", kwargs))
            self.eval(tokens)
            yield 7

    module = types.ModuleType("llama_cpp")
    module.Llama = FakeLlama
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    llama = make_method("llama-cpp", BenchContext(model, str(STORIES_GGUF), sampled))
    assert llama.generate([1, 2], 1, seed=9).token_ids == [7]
    assert calls == [("seed", 9), ("generate", dict(repeat_penalty=1.0, reset=True, temp=0.9, top_p=0.95, top_k=30,
                                                    min_p=0.0, typical_p=1.0))]
