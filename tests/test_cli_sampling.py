"""`cats generate` with --temperature --top-p --top-k --seed and --acceptance typical; bad sampling input."""

from __future__ import annotations

import json

import pytest

from cats.cli import main
from tests.conftest import STORIES_HF, needs


def generate(capsys, *args):
    code = main(["generate", "--model", str(STORIES_HF), "--prompt", "Once upon a time", "--max-new-tokens", "16",
                 "--json", "--stats", *map(str, args)])
    out, err = capsys.readouterr()
    return code, json.loads(out.rstrip("\n").split("\n")[-1]) if code == 0 else None, err


@needs(STORIES_HF)
def test_sampled_generation_is_repeatable_and_reported(capsys):
    args = ("--method", "early-exit", "--temperature", 0.8, "--top-p", 0.9, "--top-k", 50, "--seed", 3)
    code, first, err = generate(capsys, *args)
    assert code == 0 and "[early-exit, acceptance: exact, temperature 0.8, top-p 0.9, top-k 50, seed 3]" in err
    assert {k: first["stats"][k] for k in ("temperature", "top_p", "top_k", "seed", "acceptance")} == dict(
        temperature=0.8, top_p=0.9, top_k=50, seed=3, acceptance="exact")
    _, again, _ = generate(capsys, *args)
    assert again["token_ids"] == first["token_ids"]
    hot = ("--method", "early-exit", "--temperature", 1.5)  # the tiny model is sure of its stories: heat it up
    outputs = {tuple(generate(capsys, *hot, "--seed", seed)[1]["token_ids"]) for seed in (3, 4, 5)}
    assert len(outputs) > 1  # the seed matters


@needs(STORIES_HF)
def test_typical_acceptance_says_lossy(capsys):
    code, data, err = generate(capsys, "--method", "tree", "--temperature", 0.7, "--seed", 1, "--acceptance", "typical",
                               "--typical-tau", 0.2)
    assert code == 0 and "acceptance: typical (lossy) tau 0.2 alpha 0.3" in err
    assert data["stats"]["acceptance"] == "typical (lossy)" and data["stats"]["lossless"] is False


@needs(STORIES_HF)
@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "temperature must be a number >= 0"),
    (["--temperature", "1", "--top-p", "0"], r"top_p must lie in (0, 1]"),
    (["--temperature", "1", "--top-p", "1.5"], r"top_p must lie in (0, 1]"),
    (["--temperature", "1", "--top-k", "-1"], "top_k must be an integer >= 0"),
    (["--top-p", "0.9"], "top_p applies to sampling, but temperature is 0"),
    (["--method", "pld", "--typical-tau", "0.1"], "typical_tau applies to typical acceptance only"),
    (["--method", "pld", "--temperature", "1", "--typical-alpha", "0.1"], "typical_alpha applies to typical"),
    (["--acceptance", "typical"], "plain decoding (method ar) drafts none"),
    (["--method", "pld", "--acceptance", "soft"], "acceptance must be one of exact, typical"),
])
def test_bad_sampling_input_is_one_line(capsys, args, message):
    code = main(["generate", "--model", str(STORIES_HF), "--prompt", "hi", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("cats: error: ") and message in err and len(err.strip().splitlines()) == 1
