"""Prompt files for ``cats train data``: reading them and turning each prompt into chat-template token ids.

Two formats, told apart by content (not by file name):
  * ShareGPT JSON: a list of ``{"conversations": [{"from": "human" | "gpt" | ..., "value": "..."}, ...]}``; the
    prompt is the first human (or ``user``) turn. An entry without one has no prompt (``None``) and is skipped later.
  * Spec-Bench / MT-Bench JSON lines: one ``{"question_id", "turns": [...]}`` object per line, read by
    `cats.bench.questions.read_questions`; the prompt is the first turn.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from cats.bench.questions import read_questions
from cats.errors import InvalidArgumentError

SHAREGPT = "sharegpt"
QUESTIONS = "questions"
HUMAN_ROLES = ("human", "user")
EXPECTED = ('expected ShareGPT JSON (a list of {"conversations": [{"from": ..., "value": ...}]}) or Spec-Bench / '
            'MT-Bench JSON lines (one {"question_id": ..., "turns": [...]} object per line)')


@dataclass(frozen=True)
class PromptFile:
    """A prompt file's prompts in file order; ``texts[i]`` is None where entry ``i`` has no human turn."""

    path: Path
    format: str  # SHAREGPT or QUESTIONS
    texts: list[str | None]
    sha256: str  # of the file's bytes: data made from another version of the file is not resumed


def read_prompt_file(path: str | Path) -> PromptFile:
    """Read a ShareGPT JSON or Spec-Bench/MT-Bench jsonl file; anything else is an `InvalidArgumentError`."""
    path = Path(path)
    if not path.is_file():
        raise InvalidArgumentError(f"prompt file {str(path)!r} does not exist" if not path.exists()
                                   else f"prompt file {str(path)!r} is not a file")
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise InvalidArgumentError(f"prompt file {str(path)!r} is not UTF-8 text; {EXPECTED}") from None
    start = text.lstrip()[:1]
    if start == "[":
        return PromptFile(path, SHAREGPT, _sharegpt_prompts(path, text), digest)
    if start == "{" and _first_line_has_turns(text):
        return PromptFile(path, QUESTIONS, [question.turns[0] for question in read_questions(path)], digest)
    raise InvalidArgumentError(f"prompt file {str(path)!r} is in neither known format: {EXPECTED}")


def _first_line_has_turns(text: str) -> bool:
    first = next(line for line in text.splitlines() if line.strip())
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and "turns" in record


def _sharegpt_prompts(path: Path, text: str) -> list[str | None]:
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidArgumentError(f"prompt file {str(path)!r} starts like ShareGPT JSON but is not valid JSON "
                                   f"(line {error.lineno}: {error.msg})") from None
    if not isinstance(entries, list) or not entries:
        raise InvalidArgumentError(f"prompt file {str(path)!r} holds no prompts; {EXPECTED}")
    prompts = []
    for number, entry in enumerate(entries):
        where = f"{path}, entry {number}"
        if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
            raise InvalidArgumentError(f"{where}: expected an object with a 'conversations' list; {EXPECTED}")
        prompt = None
        for turn in entry["conversations"]:
            if not isinstance(turn, dict) or not all(isinstance(turn.get(key), str) for key in ("from", "value")):
                raise InvalidArgumentError(f"{where}: every conversation turn needs string 'from' and 'value'")
            if turn["from"].lower() in HUMAN_ROLES:
                prompt = turn["value"] if turn["value"].strip() else None
                break
        prompts.append(prompt)
    return prompts


def chat_prompt_ids(model, text: str, max_tokens: int) -> tuple[list[int] | None, bool]:
    """Chat-template token ids of ``text`` as one user message, at most ``max_tokens`` long.

    A longer prompt keeps the END of the user text (the question usually comes last) by dropping tokens from its
    left end and applying the template again. Returns ``(ids, truncated)``; ids is None when not even one token of the
    user text fits."""
    from cats.generate import encode_prompt

    ids = encode_prompt(model, text, chat=True)
    if len(ids) <= max_tokens:
        return ids, False
    tokenizer = model.tokenizer
    text_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    keep = min(len(text_ids), max_tokens - (len(ids) - len(text_ids)))
    while keep > 0:
        # decoding a cut can split a multi-byte character: drop the half character at the start
        cut = tokenizer.decode(text_ids[len(text_ids) - keep:]).lstrip("\ufffd")
        ids = encode_prompt(model, cut, chat=True)
        if len(ids) <= max_tokens:
            return ids, True
        keep -= len(ids) - max_tokens  # re-tokenization can merge differently: cut further by the excess
    return None, True
