"""Answer files in Spec-Bench's format, one JSON object per question:

    {"question_id", "category", "model_id", "method",
     "choices": [{"index": 0, "turns": [text per turn], "token_ids": [[ids] per turn], "new_tokens": [n per turn],
                  "wall_time": [s per turn], "accept_lengths": [tokens per target forward after the first, all turns],
                  "decoding_steps": [target forwards per turn],
                  "drafts": [[drafted, accepted] draft tokens per turn] (methods that draft)}],
     "error": null or "ExceptionType: message" (the turns answered before the error are kept),
     "tstamp"}

``token_ids`` (token-for-token equality) and ``drafts`` are CATS's additions; the other choice keys are Spec-Bench's.

An answer file is written as ``<name>.partial`` and renamed to its final name only when every question is in it,
so an interrupted run never leaves a file that looks complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cats.errors import InvalidArgumentError

PARTIAL_SUFFIX = ".partial"


def new_answer(question, model_id: str, method: str) -> dict:
    return {
        "question_id": question.question_id, "category": question.category, "model_id": model_id, "method": method,
        "choices": [{"index": 0, "turns": [], "token_ids": [], "new_tokens": [], "wall_time": [],
                     "accept_lengths": [], "decoding_steps": []}],
        "error": None, "tstamp": None,
    }


class AnswerWriter:
    """Appends answers to ``path.partial`` (flushed per question) and renames it to ``path`` in `finish`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + PARTIAL_SUFFIX)
        self.handle = open(self.partial, "w", encoding="utf-8")

    def write(self, answer: dict) -> None:
        self.handle.write(json.dumps(answer) + "\n")
        self.handle.flush()

    def finish(self) -> None:
        self.handle.close()
        os.replace(self.partial, self.path)

    def abandon(self) -> None:
        """Close without renaming: the ``.partial`` file stays, visibly incomplete."""
        self.handle.close()

    def close(self) -> None:
        """Close without renaming, for a writer in a worker process whose parent renames the file (`finish_file`)."""
        self.handle.close()


def finish_file(path: Path) -> None:
    """Rename ``path.partial`` (written and closed by a worker) to ``path``."""
    path = Path(path)
    os.replace(path.with_name(path.name + PARTIAL_SUFFIX), path)


def read_answers(path: str | Path) -> list[dict]:
    """The answers of a Spec-Bench-format file; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise InvalidArgumentError(f"answer file {str(path)!r} does not exist")
    answers = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                answer = json.loads(line)
            except json.JSONDecodeError as error:
                raise InvalidArgumentError(f"{path}, line {number}: not valid JSON ({error.msg})") from None
            if not isinstance(answer, dict) or "question_id" not in answer or not answer.get("choices"):
                raise InvalidArgumentError(f"{path}, line {number}: not an answer (needs 'question_id' and 'choices')")
            answers.append(answer)
    return answers
