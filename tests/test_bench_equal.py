"""`cats bench equal`: token-for-token comparison of two answer files, exit 0 equal, 1 not."""

import json

from cats.bench.equal import compare_answers
from cats.cli import main


def answer(qid, token_ids, error=None):
    return {"question_id": qid, "category": "c", "model_id": "m", "error": error,
            "choices": [{"index": 0, "turns": ["x"] * len(token_ids), "token_ids": token_ids,
                         "new_tokens": [len(t) for t in token_ids], "wall_time": [1.0] * len(token_ids),
                         "accept_lengths": []}]}


def write(path, answers):
    path.write_text("".join(json.dumps(a) + "\n" for a in answers))
    return str(path)


def test_equal_files(tmp_path, capsys):
    a = write(tmp_path / "a.jsonl", [answer(1, [[1, 2, 3]]), answer(2, [[4], [5, 6]])])
    b = write(tmp_path / "b.jsonl", [answer(2, [[4], [5, 6]]), answer(1, [[1, 2, 3]])])  # order does not matter
    assert compare_answers(a, b).equal
    assert main(["bench", "equal", a, b]) == 0
    assert "equal: 2 questions" in capsys.readouterr().out


def test_first_difference_is_reported(tmp_path, capsys):
    a = write(tmp_path / "a.jsonl", [answer(1, [[1, 2, 3]]), answer(2, [[4], [5, 6, 7]])])
    b = write(tmp_path / "b.jsonl", [answer(1, [[1, 2, 3]]), answer(2, [[4], [5, 9, 7]])])
    comparison = compare_answers(a, b)
    assert not comparison.equal
    assert comparison.difference == "question 2, turn 2, token 1: 6 vs 9 (lengths 3 and 3)"
    assert main(["bench", "equal", a, b]) == 1
    assert "not equal: question 2, turn 2, token 1" in capsys.readouterr().out


def test_prefix_missing_question_and_error(tmp_path):
    a = write(tmp_path / "a.jsonl", [answer(1, [[1, 2, 3]])])
    shorter = write(tmp_path / "b.jsonl", [answer(1, [[1, 2]])])
    assert "token 2: 3 vs end of output" in compare_answers(a, shorter).difference
    other = write(tmp_path / "c.jsonl", [answer(7, [[1, 2, 3]])])
    assert "question 1 is in" in compare_answers(a, other).difference
    failed = write(tmp_path / "d.jsonl", [answer(1, [[1, 2, 3]], error="RuntimeError: x")])
    assert "failed in" in compare_answers(a, failed).difference


def test_text_turns_when_token_ids_are_absent(tmp_path):
    plain = answer(1, [[1]])
    del plain["choices"][0]["token_ids"]
    plain["choices"][0]["turns"] = ["hello"]
    other = json.loads(json.dumps(plain))
    other["choices"][0]["turns"] = ["help"]
    comparison = compare_answers(write(tmp_path / "a.jsonl", [plain]), write(tmp_path / "b.jsonl", [other]))
    assert "character 3: 'l' vs 'p'" in comparison.difference


def test_bad_answer_file(tmp_path, capsys):
    good = write(tmp_path / "a.jsonl", [answer(1, [[1]])])
    assert main(["bench", "equal", good, str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl' does not exist" in capsys.readouterr().err
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(answer(1, [[1]])) + "\nnot json\n")
    assert main(["bench", "equal", good, str(broken)]) == 2
    assert "broken.jsonl, line 2: not valid JSON" in capsys.readouterr().err
