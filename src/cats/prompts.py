"""Prompts from files and text to token ids.

* Question files (Spec-Bench / MT-Bench): one JSON object per line with ``question_id``, ``category`` and ``turns``
  (a non-empty list of strings). Every problem is reported with the file and the line number.
* Prompt files (training data, calibration), told apart by content, not by file name:
  ShareGPT JSON, a list of ``{"conversations": [{"from": "human" | "gpt" | ..., "value": "..."}, ...]}`` whose
  prompt is the first human (or ``user``) turn (an entry without one has no prompt, ``None``) and whose given answer,
  if any, is the assistant (``gpt`` or ``assistant``) turn right after it; or a question file, whose prompt is each
  question's first turn (no given answers).
* Encoding: text to token ids, as one user message through the chat template with ``chat=True``.
"""

from __future__ import annotations

import hashlib
import json
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cats.errors import InvalidArgumentError, NoTokenizerError


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


SHAREGPT = "sharegpt"
QUESTIONS = "questions"
HUMAN_ROLES = ("human", "user")
ASSISTANT_ROLES = ("gpt", "assistant")
EXPECTED = ('expected ShareGPT JSON (a list of {"conversations": [{"from": ..., "value": ...}]}) or Spec-Bench / '
            'MT-Bench JSON lines (one {"question_id": ..., "turns": [...]} object per line)')


@dataclass(frozen=True)
class PromptFile:
    """A prompt file's prompts in file order; ``texts[i]`` is None where entry ``i`` has no human turn."""

    path: Path
    format: str  # SHAREGPT or QUESTIONS
    texts: list[str | None]
    sha256: str  # of the file's bytes: data made from another version of the file is not resumed
    answers: list[str | None] | None = None  # ShareGPT: the assistant turn after each prompt (None where there is none)


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
        prompts, answers = _sharegpt_turns(path, text)
        return PromptFile(path, SHAREGPT, prompts, digest, answers)
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


def _sharegpt_turns(path: Path, text: str) -> tuple[list[str | None], list[str | None]]:
    """Each entry's first human turn and the assistant turn right after it (None where missing or blank)."""
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidArgumentError(f"prompt file {str(path)!r} starts like ShareGPT JSON but is not valid JSON "
                                   f"(line {error.lineno}: {error.msg})") from None
    if not isinstance(entries, list) or not entries:
        raise InvalidArgumentError(f"prompt file {str(path)!r} holds no prompts; {EXPECTED}")
    prompts, answers = [], []
    for number, entry in enumerate(entries):
        where = f"{path}, entry {number}"
        if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
            raise InvalidArgumentError(f"{where}: expected an object with a 'conversations' list; {EXPECTED}")
        prompt = answer = None
        turns = entry["conversations"]
        for turn in turns:
            if not isinstance(turn, dict) or not all(isinstance(turn.get(key), str) for key in ("from", "value")):
                raise InvalidArgumentError(f"{where}: every conversation turn needs string 'from' and 'value'")
        for index, turn in enumerate(turns):
            if turn["from"].lower() in HUMAN_ROLES:
                prompt = turn["value"] if turn["value"].strip() else None
                after = turns[index + 1] if index + 1 < len(turns) else None
                if prompt is not None and after is not None and after["from"].lower() in ASSISTANT_ROLES:
                    answer = after["value"] if after["value"].strip() else None
                break
        prompts.append(prompt)
        answers.append(answer)
    return prompts, answers


def chat_prompt_ids(model, text: str, max_tokens: int) -> tuple[list[int] | None, bool]:
    """Chat-template token ids of ``text`` as one user message, at most ``max_tokens`` long.

    A longer prompt keeps the END of the user text (the question usually comes last) by dropping tokens from its
    left end and applying the template again. Returns ``(ids, truncated)``; ids is None when not even one token of the
    user text fits."""
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


def check_token_ids(prompt, vocab_size: int | None = None) -> list[int]:
    """``prompt`` as a list of token ids: a sequence (list, tuple, 1-D tensor or array) of integers, each in
    ``[0, vocab_size)`` when the vocabulary size is given; anything else is an `InvalidArgumentError` that says what
    was passed."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError("the prompt is bytes: pass text (decode the bytes first) or a list of token ids")
    if hasattr(prompt, "tolist") and not isinstance(prompt, (list, tuple)):  # a tensor or an array
        if getattr(prompt, "ndim", 1) != 1:
            raise InvalidArgumentError(f"prompt token ids must be one sequence, got shape {tuple(prompt.shape)}")
        prompt = prompt.tolist()
    if not isinstance(prompt, Sequence) or isinstance(prompt, str):
        raise InvalidArgumentError(f"the prompt must be text (str) or a list of token ids, got {type(prompt).__name__}")
    ids = []
    for position, token in enumerate(prompt):
        if not isinstance(token, numbers.Integral) or isinstance(token, bool):
            raise InvalidArgumentError(f"prompt token ids must be integers, got {token!r} at position {position}")
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise InvalidArgumentError(f"prompt token id {token} at position {position} is outside the model's "
                                       f"vocabulary [0, {vocab_size})")
        ids.append(int(token))
    return ids


def encode_prompt(model, prompt: str | Sequence[int], chat: bool = False, system: str | None = None) -> list[int]:
    """Token ids of a prompt: ids pass through (checked against the vocabulary); text is tokenized, as one user
    message with ``chat=True``."""
    if not isinstance(prompt, str):
        return check_token_ids(prompt, model.vocab_size)
    return encode_with(model.tokenizer, model.name, prompt, chat, system)


def encode_with(tokenizer, name: str, prompt: str | Sequence[int], chat: bool = False, system: str | None = None) -> list[int]:
    """`encode_prompt` with a tokenizer alone (e.g. before a model is loaded under a memory budget)."""
    if not isinstance(prompt, str):
        return check_token_ids(prompt)
    if tokenizer is None:
        raise NoTokenizerError(f"model {name!r} has no tokenizer: pass token ids instead of text", name)
    if not isinstance(chat, bool):
        raise InvalidArgumentError(f"chat must be True or False, got {chat!r}")
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return chat_ids(tokenizer, name, messages)
    return [int(t) for t in tokenizer(prompt)["input_ids"]]


def encode_chat(model, messages: Sequence[dict]) -> list[int]:
    """Token ids of a conversation (``[{"role": ..., "content": ...}, ...]``) through the model's chat template,
    ending with the prompt for the assistant's next message."""
    return chat_ids(model.tokenizer, model.name, messages)


def chat_ids(tokenizer, name: str, messages: Sequence[dict]) -> list[int]:
    """`encode_chat` with a tokenizer alone."""
    if tokenizer is None:
        raise NoTokenizerError(f"model {name!r} has no tokenizer: pass token ids instead of text", name)
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgumentError(f"model {name!r} has no chat template; drop --chat")
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(t) for t in ids]
