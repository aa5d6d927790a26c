"""Turning a question's turns into prompt token ids, one conversation per method.

Each method answers turn k+1 after its *own* answer to turn k (as Spec-Bench's ``eval.py`` does); for a lossless
method that answer is the same as the baseline's, so the prompts agree too.

Formats:
  * ``chat``: the tokenizer's chat template; the question's turns are user messages, earlier answers are assistant
    messages (decoded text without special tokens), and the template's generation prompt is appended.
  * ``raw``: plain text for models without a chat template. Turn 1 is tokenized as is (with the tokenizer's BOS);
    a later turn continues the previous prompt + answer token ids with ``"\\n\\n" + turn`` (no special tokens).
"""

from __future__ import annotations

from cats.errors import InvalidArgumentError, NoTokenizerError

PROMPT_FORMATS = ("chat", "raw")
TURN_SEPARATOR = "\n\n"


def check_prompt_format(model, prompt_format: str) -> None:
    if prompt_format not in PROMPT_FORMATS:
        raise InvalidArgumentError(f"unknown prompt format {prompt_format!r}; use one of {', '.join(PROMPT_FORMATS)}")
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise NoTokenizerError(f"model {model.name!r} has no tokenizer; cats bench needs one to read questions", model.name)
    if prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise InvalidArgumentError(f"model {model.name!r} has no chat template; pass --prompt-format raw")


class Conversation:
    """The prompt ids for each turn of one question, given the answers so far."""

    def __init__(self, tokenizer, prompt_format: str):
        self.tokenizer, self.prompt_format = tokenizer, prompt_format
        self.messages: list[dict] = []
        self.previous_ids: list[int] = []  # raw format: last prompt + its answer

    def prompt_ids(self, turn: str) -> list[int]:
        """Token ids of the prompt that asks ``turn`` (after the turns already answered)."""
        if self.prompt_format == "chat":
            self.messages.append({"role": "user", "content": turn})
            ids = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
            return [int(t) for t in ids]
        if not self.previous_ids:
            return [int(t) for t in self.tokenizer(turn)["input_ids"]]
        continuation = self.tokenizer(TURN_SEPARATOR + turn, add_special_tokens=False)["input_ids"]
        return self.previous_ids + [int(t) for t in continuation]

    def add_answer(self, prompt_ids: list[int], answer_ids: list[int]) -> None:
        if self.prompt_format == "chat":
            text = self.tokenizer.decode(answer_ids, skip_special_tokens=True)
            self.messages.append({"role": "assistant", "content": text})
        else:
            self.previous_ids = list(prompt_ids) + list(answer_ids)
