"""End-to-end: the `cats` console script as a user runs it."""

from __future__ import annotations

import json
import subprocess

import pytest

import cats
import cats.cli.serve as serve_command
from cats.cli import build_parser, main
from cats.model.adapter import new_adapter
from cats.verify.cascade import SV_THRESHOLD
from tests.conftest import REPO_ROOT, SMOLLM2, STORIES_HF, needs


def cats_cli(*args, cwd=REPO_ROOT):
    return subprocess.run(["cats", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=600)


@needs(STORIES_HF)
def test_generate_streams_text_and_prints_json_last(capsys):
    """`ar` through the console script; the other methods through `cats.cli.main` in this process (the same code
    after the interpreter's start, without importing torch once per method)."""
    runs = {}
    for method in ("ar", "pld", "early-exit"):
        args = ["generate", "--model", str(STORIES_HF), "--prompt", "Once upon a time", "--max-new-tokens", "24",
                "--method", method, "--json", "--stats"]
        if method == "ar":
            proc = cats_cli(*args)
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        else:
            code = main(args)
            out, err = capsys.readouterr()
        assert code == 0, err
        lines = out.rstrip("\n").split("\n")
        data = json.loads(lines[-1])
        assert set(data) == {"text", "token_ids", "prompt_token_ids", "stats"}
        assert "\n".join(lines[:-1]) == data["text"]
        assert len(data["token_ids"]) == data["stats"]["new_tokens"] == 24
        assert f"[{method}, acceptance: exact, greedy]" in err
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
def test_user_errors_are_one_line(args, message, capsys):
    """Run in this process (`cats.cli.main`, what the console script calls): a process per case would spend most of
    its time importing torch; `test_missing_model_is_one_line` runs the console script itself."""
    code = main(["generate", "--model", str(STORIES_HF), "--prompt", "hi", *args])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cats: error: ") and message in lines[0], captured.err
    assert "Traceback" not in captured.err


def test_missing_model_is_one_line(tmp_path):
    proc = cats_cli("generate", "--model", tmp_path / "absent", "--prompt", "hi")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("cats: error: model path") and "does not exist" in proc.stderr


@needs(SMOLLM2)
def test_readme_quick_start_on_the_default_model():
    """The README's first command: the default model is SmolLM2-135M-Instruct from ../shared. (Its Q4_1 file is at a
    near-tie on "What is the capital of France?": llama.cpp answers "L'Étoile, la Marseillaise," there; this
    wording it answers with a clear margin on every path.)"""
    proc = cats_cli("generate", "--chat", "--prompt", "Tell me the capital of France.", "--max-new-tokens", 12,
                    "--method", "pld", "--stats")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


@needs(STORIES_HF)
def test_generate_with_adapters(tmp_path, capsys):
    """In this process (`cats.cli.main`): the console script itself is run by the tests above."""
    model = cats.load_model(STORIES_HF)
    new_adapter(model, "draft", 2, vocab_subset=list(range(300))).save(tmp_path / "adapters" / "draft")
    outputs = {}
    for method, extra in (("ar", []), ("early-exit", ["--adapters", tmp_path / "adapters", "--threshold", "0.1"])):
        code = main(["generate", "--model", str(STORIES_HF), "--prompt", "Once upon a time", "--max-new-tokens", "20",
                     "--method", method, "--json", *map(str, extra)])
        out, err = capsys.readouterr()
        assert code == 0, err
        outputs[method] = json.loads(out.splitlines()[-1])["token_ids"]
    assert outputs["ar"] == outputs["early-exit"]
    code = main(["generate", "--model", str(STORIES_HF), "--prompt", "hi", "--method", "pld", "--adapters",
                 str(tmp_path / "adapters")])
    assert code == 2 and "apply to early-exit" in capsys.readouterr().err
    code = main(["generate", "--model", str(STORIES_HF), "--prompt", "hi", "--method", "early-exit", "--adapters",
                 str(tmp_path)])
    assert code == 2 and "no draft adapter" in capsys.readouterr().err


def test_flag_defaults_match_the_library_defaults():
    """The CLI keeps literal defaults (it parses without importing torch); they must equal the library's."""
    parser = build_parser()
    for command in (["generate", "--prompt", "x"], ["bench", "--questions", "q.jsonl", "--out", "o"]):
        args = parser.parse_args(command)
        assert args.sv_threshold == SV_THRESHOLD, command
        assert args.threshold is None, command  # None: the method's own confidence stop (cats.methods.CONFIDENCE_STOP)


def test_serve_without_the_serve_extra_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(serve_command, "SERVE_MISSING", ["fastapi"])
    assert main(["serve", "--port", "0"]) == 2
    assert "pip install 'cats[serve]'" in capsys.readouterr().err
