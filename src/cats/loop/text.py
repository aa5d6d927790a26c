"""Incremental detokenization: text deltas whose concatenation is exactly the text of all the tokens.

Decoding token by token is wrong for multi-byte characters split across tokens and for tokenizers that merge or
clean up spaces, so every step decodes the whole output and sends only the part that can no longer change. Text
is held back while it may still change: an incomplete UTF-8 character (U+FFFD at the end), trailing whitespace
(a space may be cleaned up before punctuation), and the last ``len(stop) - 1`` characters, which may be the start
of a stop string. Stop strings are cut off the text (OpenAI semantics: the stop string is not returned)."""

from __future__ import annotations

from collections.abc import Sequence

from cats.errors import InvalidArgumentError


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already returned as deltas
        self.stopped: str | None = None  # the final text, once a stop string has appeared

    def text(self) -> str:
        """The text so far, cut before the first stop string (later tokens are ignored once one appeared)."""
        if self.stopped is not None:
            return self.stopped
        return self._cut(self.tokenizer.decode(self.ids, skip_special_tokens=True))[0]

    def _cut(self, text: str) -> tuple[str, bool]:
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return (text[: min(found)], True) if found else (text, False)

    def add(self, tokens: Sequence[int]) -> str:
        """Take the next committed tokens; return the new text that is now final ('' if none)."""
        if self.stopped is not None:
            return ""
        self.ids.extend(int(t) for t in tokens)
        text, stopped = self._cut(self.tokenizer.decode(self.ids, skip_special_tokens=True))
        if stopped:
            self.stopped = text
            return self._send(text, len(text))
        # Trailing whitespace may still vanish (a decode that drops a space before punctuation), and what stands before
        # it may then join the next characters into a stop string: the holdback counts from the last visible character.
        return self._send(text, len(text.rstrip("\ufffd").rstrip()) - self.holdback)

    def finish(self) -> str:
        """The rest of the text, after the last tokens."""
        text = self.text()
        return self._send(text, len(text))

    def _send(self, text: str, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta, self.sent = text[self.sent : upto], upto
        return delta


class StopStrings:
    """Finds the first token at which the decoded output contains a stop string."""

    def __init__(self, tokenizer, stops: Sequence[str]):
        if tokenizer is None:
            raise InvalidArgumentError("stop strings need a model with a tokenizer")
        self.tokenizer, self.stops, self.generated = tokenizer, list(stops), []

    def find(self, tokens: list[int]) -> int | None:
        """Append ``tokens``; return how many of them to keep if a stop string completed, else None."""
        base = len(self.generated)
        self.generated.extend(tokens)
        for i in range(len(tokens)):
            text = self.tokenizer.decode(self.generated[: base + i + 1])
            if any(stop in text for stop in self.stops):
                return i + 1
        return None
