"""The OpenAI request bodies this server accepts, and OpenAI-shaped errors.

Bodies are strict: a field of the wrong type or one the server does not implement (``tools``, ``logprobs``,
penalties, ``n`` > 1, ...) is a 400 naming it, never silently ignored. Extensions, as in llama.cpp's and vLLM's
servers: ``top_k`` (with sampling) and ``ignore_eos``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class DecodingFields(Strict):
    """The fields shared by both endpoints."""

    model: str | None = None  # optional: the one served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: str | None = None  # OpenAI's end-user id, for the provider's abuse monitoring: no effect on output
    ignore_eos: bool = False

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(DecodingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(DecodingFields):
    # one prompt: text or token ids (a one-element list of either is accepted too; several prompts are not)
    prompt: str | list[int] | list[str] | list[list[int]]

    def token_limit(self) -> int | None:
        return self.max_tokens


FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "context_length": "length"}


def validation_error(errors: list[dict]) -> APIError:
    """A 400 from pydantic's errors: the first one, its field path as ``param`` (``messages[0].role``)."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({first.get('msg')})", code="invalid_json")
    path = ""
    for part in first.get("loc", ()):
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _UNION_TAGS or "[" in part:  # pydantic names the union member it tried: not part of the path
            break
        elif part != "body":
            path += f".{part}" if path else part
    if first.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {path} (this server does not implement it)"
    elif first.get("type") == "missing":
        message = f"Missing required argument: {path}"
    else:
        message = f"{path}: {first.get('msg')}" if path else str(first.get("msg"))
    return APIError(400, message, param=path or None, code=first.get("type"))


_UNION_TAGS = {"str", "int", "float", "bool"}
