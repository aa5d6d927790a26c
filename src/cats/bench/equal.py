"""``cats bench equal A.jsonl B.jsonl``: are two answer files token-for-token equal (as Spec-Bench's
``evaluation/equal.py`` checks, by question rather than by line), and where is the first difference?

Token ids are compared when both files have them (CATS answer files do), else the text of each turn."""

from __future__ import annotations

from dataclasses import dataclass

from cats.bench.answers import read_answers
from cats.bench.summary import choice


@dataclass
class Comparison:
    equal: bool
    questions: int  # questions compared
    difference: str = ""  # where the first difference is, in words


def _first_difference(a: list, b: list) -> int:
    """Index of the first differing element; ``min(len)`` when one is a prefix of the other."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return min(len(a), len(b))


def compare_answers(path_a: str, path_b: str) -> Comparison:
    answers_a, answers_b = read_answers(path_a), read_answers(path_b)
    by_id_b = {answer["question_id"]: answer for answer in answers_b}
    ids_a = [answer["question_id"] for answer in answers_a]
    missing_in_b = [qid for qid in ids_a if qid not in by_id_b]
    if missing_in_b:
        return Comparison(False, 0, f"question {missing_in_b[0]!r} is in {path_a} but not in {path_b}")
    extra_in_b = [answer["question_id"] for answer in answers_b if answer["question_id"] not in set(ids_a)]
    if extra_in_b:
        return Comparison(False, 0, f"question {extra_in_b[0]!r} is in {path_b} but not in {path_a}")
    for count, answer_a in enumerate(answers_a):
        qid, answer_b = answer_a["question_id"], by_id_b[answer_a["question_id"]]
        for answer, path in ((answer_a, path_a), (answer_b, path_b)):
            if answer.get("error"):
                return Comparison(False, count, f"question {qid!r} failed in {path}: {answer['error']}")
        choice_a, choice_b = choice(answer_a), choice(answer_b)
        use_ids = "token_ids" in choice_a and "token_ids" in choice_b
        turns_a = choice_a["token_ids"] if use_ids else choice_a["turns"]
        turns_b = choice_b["token_ids"] if use_ids else choice_b["turns"]
        if len(turns_a) != len(turns_b):
            return Comparison(False, count, f"question {qid!r}: {len(turns_a)} turns vs {len(turns_b)}")
        for turn, (a, b) in enumerate(zip(turns_a, turns_b), start=1):
            if a == b:
                continue
            at = _first_difference(a, b)
            unit = "token" if use_ids else "character"
            shown_a = repr(a[at]) if at < len(a) else "end of output"
            shown_b = repr(b[at]) if at < len(b) else "end of output"
            return Comparison(False, count, f"question {qid!r}, turn {turn}, {unit} {at}: {shown_a} vs {shown_b} "
                                            f"(lengths {len(a)} and {len(b)})")
    return Comparison(True, len(answers_a))
