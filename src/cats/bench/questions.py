"""Reading Spec-Bench / MT-Bench question files: one JSON object per line with ``question_id``, ``category`` and
``turns`` (a non-empty list of strings). Every problem is reported with the file and the line number."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cats.errors import InvalidArgumentError


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    turns: tuple[str, ...]


def read_questions(path: str | Path) -> list[Question]:
    """All questions of a ``.jsonl`` file, in file order (blank lines are skipped)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidArgumentError(f"question file {str(path)!r} does not exist" if not path.exists()
                                   else f"question file {str(path)!r} is not a file")
    questions, seen = [], set()
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise InvalidArgumentError(f"{where}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise InvalidArgumentError(f"{where}: expected a JSON object, got {type(record).__name__}")
            for key in ("question_id", "turns"):
                if key not in record:
                    raise InvalidArgumentError(f"{where}: missing '{key}'")
            turns = record["turns"]
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise InvalidArgumentError(f"{where}: 'turns' must be a non-empty list of strings")
            question_id = record["question_id"]
            if question_id in seen:
                raise InvalidArgumentError(f"{where}: duplicate question_id {question_id!r}")
            seen.add(question_id)
            questions.append(Question(question_id, str(record.get("category", "uncategorized")), tuple(turns)))
    if not questions:
        raise InvalidArgumentError(f"question file {str(path)!r} holds no questions")
    return questions


def select_questions(
    questions: Sequence[Question], per_category: int | None = None, limit: int | None = None
) -> list[Question]:
    """A deterministic selection in file order: the first ``per_category`` questions of each category (a stratified
    subset), then the first ``limit`` of those."""
    selected = list(questions)
    if per_category is not None:
        taken: dict[str, int] = {}
        kept = []
        for question in selected:
            if taken.get(question.category, 0) < per_category:
                taken[question.category] = taken.get(question.category, 0) + 1
                kept.append(question)
        selected = kept
    if limit is not None:
        selected = selected[:limit]
    if not selected:
        raise InvalidArgumentError("the selection is empty: no question left after --per-category/--limit")
    return selected
