"""The HTTP routes: OpenAI's ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``, plus ``/health``.

Every response that generated text carries OpenAI's ``usage`` and a ``cats`` object: the method, the acceptance
rule, mean accepted tokens per target forward, tokens/s and the other `GenerationStats` counters. A streamed
response (server-sent events, ending with ``data: [DONE]``) carries them in its last chunk, the one with the
``finish_reason``."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import cats
from cats.config import (
    DEFAULT_TEMPERATURE,
    GenerationConfig,
    OptionError,
    request_config,
)
from cats.loop.text import IncrementalDetokenizer
from cats.prompts import encode_chat
from cats.serve.engine import Engine, QueueFullError, Run, ShuttingDownError
from cats.serve.protocol import (
    FINISH_REASONS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    validation_error,
)

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions; chat defaults to the context left


def shutting_down(message: str = "the server is shutting down") -> APIError:
    return APIError(503, message, type="server_error", code="shutting_down")


class EventStream(StreamingResponse):
    """Server-sent events. However the response ends (a client that went away included), the body generator is
    closed and ``on_close`` runs: it cancels the generation."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            await self.body_iterator.aclose()


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def until_disconnected(request: Request, awaitable):
    """Await ``awaitable``; if the client disconnects first, cancel it and return None."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait({task})
    return None


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class CompletionService:
    """Turns requests into runs of the `Engine` and runs into OpenAI responses."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine, self.model, self.model_name = engine, engine.model, model_name
        self.tokenizer = engine.model.tokenizer
        self.created = int(time.time())

    # -- requests ---------------------------------------------------------------------------------------------
    @staticmethod
    def parse(model: type[BaseModel], raw: bytes):
        try:
            return model.model_validate_json(raw or b"null")
        except ValidationError as error:
            raise validation_error(error.errors()) from None

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model {name!r} does not exist: this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, f"model {self.model_name!r} has no chat template: use /v1/completions",
                           param="messages", code="no_chat_template")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        try:
            return encode_chat(self.model, messages)
        except Exception as error:  # the template's own checks (jinja2 raise_exception), e.g. role order
            raise APIError(400, f"the chat template rejected the messages: {error}", param="messages") from None

    def text_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request, got {len(prompt)}", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = [int(t) for t in self.tokenizer(prompt)["input_ids"]]
        else:
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.model.vocab_size]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {self.model.vocab_size})",
                               param="prompt")
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        return ids

    def config(self, body, prompt_ids: list[int], chat: bool) -> GenerationConfig:
        context = self.model.usable_context
        room, limit = context - len(prompt_ids), body.token_limit()
        if room < 1 or (limit is not None and limit > room):
            planned = (" (the KV cache this server's memory budget planned: start it with a larger --max-context)"
                       if context < self.model.context_length else "")
            raise APIError(
                400, f"This model's maximum context length is {context} tokens{planned}. However, you requested "
                f"{len(prompt_ids) + (limit or 0)} tokens ({len(prompt_ids)} in the prompt, {limit or 0} for the "
                "completion). Please reduce the prompt or max_tokens.",
                param="max_tokens" if room >= 1 else ("messages" if chat else "prompt"), code="context_length_exceeded")
        if limit is None:
            limit = room if chat else min(DEFAULT_COMPLETION_TOKENS, room)
        try:
            return request_config(limit, body.stop_strings(), body.ignore_eos, body.temperature, body.top_p, body.top_k,
                               body.seed)
        except OptionError as error:
            raise APIError(400, str(error), param=error.param,
                           code="sampling_unavailable" if "sampling" in str(error) else None) from None

    # -- responses --------------------------------------------------------------------------------------------
    async def complete(self, request: Request, chat: bool) -> Response:
        body = self.parse(ChatCompletionRequest if chat else CompletionRequest, await request.body())
        self.check_model(body.model)
        prompt_ids = self.chat_prompt(body) if chat else self.text_prompt(body)
        config = self.config(body, prompt_ids, chat)
        try:
            run = await until_disconnected(request, self.engine.start(prompt_ids, config))
        except QueueFullError as error:
            raise APIError(429, f"{error}; retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.engine.retry_after())}) from None
        except ShuttingDownError as error:
            raise shutting_down() from error
        if run is None:  # the client left while queued: nobody reads this answer
            return Response(status_code=499)
        reply = Reply(self, run, body, chat)
        if body.stream:
            return EventStream(reply.events(), on_close=run.cancel)
        try:
            text = await until_disconnected(request, reply.text())
        finally:
            run.cancel()
        if text is None:
            return Response(status_code=499)
        if run.outcome == "cancelled":
            raise shutting_down("the server is shutting down: the answer was stopped")
        return JSONResponse(reply.response(text))

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        return {
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "cats",
            "cats": {"method": self.engine.generator.method, "acceptance": "exact",  # the server never runs typical
                     "context_length": self.model.usable_context, "sampling_available": True,
                     "default_temperature": DEFAULT_TEMPERATURE, "max_queue": self.engine.max_queue,
                     "memory_plan": self.model.memory_plan.to_dict() if self.model.memory_plan else None,
                     "version": cats.__version__},
        }


class Reply:
    """The answer to one request, built from its run's chunks (streamed or whole: the same text either way)."""

    def __init__(self, service: CompletionService, run: Run, body, chat: bool):
        self.service, self.run, self.body, self.chat = service, run, body, chat
        self.detokenizer = IncrementalDetokenizer(service.tokenizer, body.stop_strings())
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    async def text(self) -> str:
        parts = [self.detokenizer.add(chunk) async for chunk in self.run.chunks()]
        return "".join(parts) + self.detokenizer.finish()

    def finish_reason(self) -> str:
        return FINISH_REASONS.get(self.run.stats.stop_reason, "stop")

    def usage(self) -> dict:
        prompt, completion = len(self.run.prompt_ids), self.run.stats.new_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def stats(self) -> dict:
        data = self.run.stats.to_dict()
        data.pop("accept_lengths")
        data.update(queue_s=round(self.run.queue_s, 4), temperature=getattr(self.run.config, "temperature", 0.0))
        return data

    def head(self) -> dict:
        return {"id": self.id, "object": ("chat.completion" if self.chat else "text_completion"),
                "created": self.created, "model": self.service.model_name}

    def response(self, text: str) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": self.finish_reason()}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason()}
        return {**self.head(), "choices": [choice], "usage": self.usage(), "cats": self.stats()}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict:
        head = {**self.head(), "object": "chat.completion.chunk" if self.chat else "text_completion"}
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**head, "choices": [choice]}

    async def events(self) -> AsyncIterator[str]:
        try:
            if self.chat:
                yield sse(self.chunk("", role=True))
            async for tokens in self.run.chunks():
                delta = self.detokenizer.add(tokens)
                if delta:
                    yield sse(self.chunk(delta))
            if self.run.outcome == "cancelled":  # by the server's shutdown: a client that left reads nothing
                yield sse(shutting_down("the server is shutting down: the answer was stopped").body())
                yield sse("[DONE]")
                return
            delta = self.detokenizer.finish()
            if delta:
                yield sse(self.chunk(delta))
            yield sse({**self.chunk(None, self.finish_reason()), "usage": self.usage(), "cats": self.stats()})
            if self.body.stream_options is not None and self.body.stream_options.include_usage:
                yield sse({**self.head(), "object": self.chunk(None)["object"], "choices": [], "usage": self.usage()})
            yield sse("[DONE]")
        except Exception as error:  # headers are sent: report in the stream, as OpenAI does
            yield sse(error_body(f"generation failed: {error}", type="server_error"))
            yield sse("[DONE]")
        finally:
            self.run.cancel()


def create_app(engine: Engine, model_name: str) -> FastAPI:
    """The FastAPI application serving ``engine``'s model under the name ``model_name``."""
    service = CompletionService(engine, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.loop = asyncio.get_running_loop()
        yield
        engine.cancel_active()  # a generation still running at the very end stops at its next target forward

    app = FastAPI(title="CATS", version=cats.__version__, lifespan=lifespan,
                  description="OpenAI-compatible server for lossless self-speculative decoding")
    app.state.service = service

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError):
        return await api_error(request, validation_error(list(error.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        body = error_body(f"{error.detail}: {request.method} {request.url.path}", code=str(error.status_code))
        return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, **engine.health()}

    @app.get("/v1/models")
    async def models():
        return service.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        service.check_model(model_id)
        return service.model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await service.complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await service.complete(request, chat=False)

    return app
