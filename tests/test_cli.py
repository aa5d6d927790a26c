"""End-to-end: the `cats` console script as a user runs it."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import REPO_ROOT, SMOLLM2, STORIES_HF, needs


def cats_cli(*args, cwd=REPO_ROOT):
    return subprocess.run(["cats", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=600)


@needs(STORIES_HF)
def test_generate_streams_text_and_prints_json_last():
    runs = {}
    for method in ("ar", "pld", "early-exit"):
        proc = cats_cli("generate", "--model", STORIES_HF, "--prompt", "Once upon a time", "--max-new-tokens", 24,
                        "--method", method, "--json", "--stats")
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.rstrip("\n").split("\n")
        data = json.loads(lines[-1])
        assert set(data) == {"text", "token_ids", "prompt_token_ids", "stats"}
        assert "\n".join(lines[:-1]) == data["text"]
        assert len(data["token_ids"]) == data["stats"]["new_tokens"] == 24
        assert f"[{method}, acceptance: exact, greedy]" in proc.stderr
        runs[method] = data["token_ids"]
    assert runs["ar"] == runs["pld"] == runs["early-exit"]


@needs(STORIES_HF)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--method", "medusa"], "unknown method 'medusa'; known methods: ar, pld, early-exit"),
        (["--max-new-tokens", "0"], "max_new_tokens must be a positive integer"),
        (["--method", "early-exit", "--draft-layer", "9"], r"draft layer 9 is outside [1, 5)"),
        (["--chat"], "no chat template"),
        (["--dtype", "int3"], "unknown dtype"),
        (["--pack-weights", "--dtype", "float16"], "prepacking is for bfloat16 and float32 weights"),
        (["--pack-weights", "--dtype", "bfloat16", "--memory-budget", "50%"], "memory budget does not plan for"),
    ],
)
def test_user_errors_are_one_line(args, message):
    proc = cats_cli("generate", "--model", STORIES_HF, "--prompt", "hi", *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cats: error: ") and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_model_is_one_line(tmp_path):
    proc = cats_cli("generate", "--model", tmp_path / "absent", "--prompt", "hi")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("cats: error: model path") and "does not exist" in proc.stderr


@needs(SMOLLM2)
def test_readme_quick_start_on_the_default_model():
    """The README's first command: the default model is SmolLM2-135M-Instruct from ../shared."""
    proc = cats_cli("generate", "--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", 12,
                    "--method", "pld", "--stats")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


@needs(STORIES_HF)
def test_generate_with_adapters(tmp_path):
    import cats
    from cats.model.adapter import new_adapter

    model = cats.load_model(STORIES_HF)
    new_adapter(model, "draft", 2, vocab_subset=list(range(300))).save(tmp_path / "adapters" / "draft")
    outputs = {}
    for method, extra in (("ar", []), ("early-exit", ["--adapters", tmp_path / "adapters", "--threshold", "0.1"])):
        proc = cats_cli("generate", "--model", STORIES_HF, "--prompt", "Once upon a time", "--max-new-tokens", 20,
                        "--method", method, "--json", *extra)
        assert proc.returncode == 0, proc.stderr
        outputs[method] = json.loads(proc.stdout.splitlines()[-1])["token_ids"]
    assert outputs["ar"] == outputs["early-exit"]
    proc = cats_cli("generate", "--model", STORIES_HF, "--prompt", "hi", "--method", "pld", "--adapters", tmp_path / "adapters")
    assert proc.returncode == 2 and "apply to early-exit" in proc.stderr
    proc = cats_cli("generate", "--model", STORIES_HF, "--prompt", "hi", "--method", "early-exit", "--adapters", tmp_path)
    assert proc.returncode == 2 and "no draft adapter" in proc.stderr


def test_flag_defaults_match_the_library_defaults():
    """The CLI keeps literal defaults (it parses without importing torch); they must equal the library's."""
    from cats.verify.cascade import SV_THRESHOLD
    from cats.cli import build_parser

    parser = build_parser()
    for command in (["generate", "--prompt", "x"], ["bench", "--questions", "q.jsonl", "--out", "o"]):
        args = parser.parse_args(command)
        assert args.sv_threshold == SV_THRESHOLD, command
        assert args.threshold is None, command  # None: the method's own confidence stop (cats.methods.CONFIDENCE_STOP)


def test_serve_without_the_serve_extra_says_what_to_install(monkeypatch, capsys):
    import cats.cli.serve as serve_command
    from cats.cli import main

    monkeypatch.setattr(serve_command, "SERVE_MISSING", ["fastapi"])
    assert main(["serve", "--port", "0"]) == 2
    assert "pip install 'cats[serve]'" in capsys.readouterr().err
