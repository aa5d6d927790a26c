"""Question files: parsing, selection, and the errors for bad input (they name the file and the line)."""

import json

import pytest

from cats.prompts import read_questions, select_questions
from cats.errors import InvalidArgumentError


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def question(qid, category="writing", turns=("Hi?",)):
    return json.dumps({"question_id": qid, "category": category, "turns": list(turns)})


def test_reads_questions_in_file_order(tmp_path):
    path = write_lines(tmp_path / "q.jsonl", [question(3, "a", ["x", "y"]), "", question(1, "b")])
    questions = read_questions(path)
    assert [q.question_id for q in questions] == [3, 1]
    assert questions[0].turns == ("x", "y") and questions[1].category == "b"


def test_missing_file_is_named(tmp_path):
    with pytest.raises(InvalidArgumentError, match="nope.jsonl.*does not exist"):
        read_questions(tmp_path / "nope.jsonl")


def test_non_json_line_names_file_and_line(tmp_path):
    path = write_lines(tmp_path / "q.jsonl", [question(1), "{not json"])
    with pytest.raises(InvalidArgumentError, match=r"q\.jsonl, line 2: not valid JSON"):
        read_questions(path)


def test_missing_turns_names_file_and_line(tmp_path):
    path = write_lines(tmp_path / "q.jsonl", [question(1), question(2), json.dumps({"question_id": 3})])
    with pytest.raises(InvalidArgumentError, match=r"q\.jsonl, line 3: missing 'turns'"):
        read_questions(path)


@pytest.mark.parametrize("turns", [[], "text", [1, 2]])
def test_bad_turns(tmp_path, turns):
    path = write_lines(tmp_path / "q.jsonl", [json.dumps({"question_id": 1, "turns": turns})])
    with pytest.raises(InvalidArgumentError, match="line 1: 'turns' must be a non-empty list of strings"):
        read_questions(path)


def test_duplicate_question_id(tmp_path):
    path = write_lines(tmp_path / "q.jsonl", [question(1), question(1)])
    with pytest.raises(InvalidArgumentError, match="line 2: duplicate question_id 1"):
        read_questions(path)


def test_empty_file(tmp_path):
    path = write_lines(tmp_path / "q.jsonl", [""])
    with pytest.raises(InvalidArgumentError, match="holds no questions"):
        read_questions(path)


def test_selection_is_stratified_then_limited(tmp_path):
    lines = [question(i, "ab"[i % 2]) for i in range(10)]
    questions = read_questions(write_lines(tmp_path / "q.jsonl", lines))
    assert [q.question_id for q in select_questions(questions, per_category=2)] == [0, 1, 2, 3]
    assert [q.question_id for q in select_questions(questions, per_category=2, limit=3)] == [0, 1, 2]
    assert [q.question_id for q in select_questions(questions, limit=1)] == [0]


def test_empty_selection(tmp_path):
    questions = read_questions(write_lines(tmp_path / "q.jsonl", [question(1)]))
    with pytest.raises(InvalidArgumentError, match="selection is empty"):
        select_questions(questions, limit=0)
