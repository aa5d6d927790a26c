"""`cats serve`: a real server on loopback, spoken to over HTTP (httpx and the `openai` client).

The in-process server runs uvicorn on a thread with stories260K (a real model folder and tokenizer, given a
chat template); the last test starts `cats serve` as a process and stops it with SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from tests.conftest import REPO_ROOT, STORIES_HF, needs

fastapi = pytest.importorskip("fastapi", reason="the server needs the serve extra: pip install 'cats[serve]'")
uvicorn = pytest.importorskip("uvicorn", reason="the server needs the serve extra: pip install 'cats[serve]'")
httpx = pytest.importorskip("httpx", reason="the server tests talk to it with httpx (the dev extra)")

from cats.bench.llama_server import free_port  # noqa: E402
from cats.config import DEFAULT_TEMPERATURE  # noqa: E402
from cats.config import GenerationConfig
from cats.loop.generator import Generator
from cats.prompts import encode_chat  # noqa: E402

pytestmark = needs(STORIES_HF)

STORY = "Once upon a time"
MAX_QUEUE = 1


@pytest.fixture(scope="module")
def model_dir(stories_chat_dir):
    return stories_chat_dir


@pytest.fixture(scope="module")
def model(model_dir):
    import cats

    return cats.load_model(str(model_dir))


@contextmanager
def live_server(model):
    """Base URL of a live server of ``model``: method pld, at most MAX_QUEUE waiting requests."""
    from cats.draft import PromptLookupDrafter
    from cats.serve.app import create_app
    from cats.serve.engine import Engine

    engine = Engine(Generator(model, PromptLookupDrafter(num_tokens=10)), max_queue=MAX_QUEUE)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(create_app(engine, "stories"), host="127.0.0.1", port=port,
                                       log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(model):
    with live_server(model) as base:
        yield base


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server, timeout=60) as client:
        yield client


def greedy_text(model, prompt_ids, max_new_tokens) -> str:
    """Plain greedy decoding (no drafter) in-process: the text every answer must equal."""
    return Generator(model).generate(prompt_ids, GenerationConfig(max_new_tokens=max_new_tokens)).text


def chat_ids(model, content=STORY):
    return encode_chat(model, [{"role": "user", "content": content}])


def events(response) -> list:
    """The data of each server-sent event; the literal [DONE] stays a string."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def health(client) -> dict:
    return client.get("/health").json()


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["stories"]
    card = models["data"][0]["cats"]
    assert card["method"] == "pld" and card["acceptance"] == "exact" and card["context_length"] == 2048
    assert card["sampling_available"] is True
    assert card["default_temperature"] == DEFAULT_TEMPERATURE
    assert client.get("/v1/models/stories").json()["id"] == "stories"
    assert client.get("/v1/models/gpt-4").status_code == 404
    state = health(client)
    assert state["status"] == "ok" and state["busy"] is False and state["max_queue"] == MAX_QUEUE


def test_chat_completion_is_the_greedy_output(client, model):
    response = client.post("/v1/chat/completions", json={
        "model": "stories", "messages": [{"role": "user", "content": STORY}], "max_tokens": 24, "temperature": 0})
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "chat.completion" and data["model"] == "stories"
    choice = data["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": greedy_text(model, chat_ids(model), 24)}
    assert choice["finish_reason"] == "length"
    prompt_tokens = len(chat_ids(model))
    assert data["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 24, "total_tokens": prompt_tokens + 24}
    stats = data["cats"]
    assert stats["method"] == "pld" and stats["acceptance"] == "exact" and stats["new_tokens"] == 24
    assert stats["mean_accepted"] >= 1.0 and stats["tokens_per_s"] > 0 and stats["temperature"] == 0.0
    assert stats["target_forwards"] == stats["decode_steps"] + 1


@pytest.mark.parametrize("endpoint, body", [
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Tell a story."},
                                           {"role": "user", "content": [{"type": "text", "text": STORY}]}]}),
    ("/v1/completions", {"prompt": STORY}),
    ("/v1/completions", {"prompt": STORY, "stop": [" named", "xyz never"]}),  # holds back, then cuts the stop
])
def test_streamed_text_equals_non_streamed_text(client, endpoint, body):
    body = {**body, "max_tokens": 40, "temperature": 0}
    whole = client.post(endpoint, json=body).json()
    with client.stream("POST", endpoint, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        received = events(response)
    assert received[-1] == "[DONE]"
    usage_chunk, final, chunks = received[-2], received[-3], received[:-3]
    chat = endpoint.endswith("chat/completions")
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        text = whole["choices"][0]["message"]["content"]
        assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in received[:-1])
    else:
        streamed = "".join(c["choices"][0]["text"] for c in chunks)
        text = whole["choices"][0]["text"]
    assert len(chunks) > 3  # it really streamed
    assert streamed == text and text
    assert final["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert final["usage"] == whole["usage"] == usage_chunk["usage"] and usage_chunk["choices"] == []
    assert final["cats"]["method"] == "pld" and final["cats"]["new_tokens"] == whole["usage"]["completion_tokens"]
    if "stop" in body:
        assert whole["choices"][0]["finish_reason"] == "stop" and text.endswith("girl")
        assert " named" not in text and whole["cats"]["stop_reason"] == "stop_string"


def test_completion_prompt_as_token_ids_and_default_length(client, model):
    ids = model.tokenizer(STORY)["input_ids"]
    data = client.post("/v1/completions", json={"prompt": ids, "temperature": 0}).json()
    assert data["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens for completions
    assert data["choices"][0]["text"] == greedy_text(model, ids, 16)


@pytest.mark.parametrize("endpoint, raw, param, words", [
    ("/v1/chat/completions", b"{not json", None, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", None, "object"),
    ("/v1/chat/completions", {"max_tokens": 5}, "messages", "Missing required argument"),
    ("/v1/chat/completions", {"messages": []}, "messages", "at least 1"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "'user'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": []}, "tools", "Unrecognized"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n", "1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens", ""),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2048}, "max_tokens",
     "maximum context length is 2048"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature", ""),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream", "boolean"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop", "empty"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", "one prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt", "vocabulary"),
    ("/v1/completions", {"prompt": "hi " * 2100}, "prompt", "maximum context length"),
])
def test_malformed_requests_are_openai_shaped_400s(client, endpoint, raw, param, words):
    kwargs = {"content": raw} if isinstance(raw, bytes) else {"json": raw}
    response = client.post(endpoint, headers={"content-type": "application/json"}, **kwargs)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"]


def test_unknown_model_is_404(client):
    for endpoint, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})):
        response = client.post(endpoint, json={"model": "gpt-4o", **body})
        assert response.status_code == 404
        assert response.json()["error"] == {"message": "The model 'gpt-4o' does not exist: this server serves 'stories'",
                                             "type": "invalid_request_error", "param": "model",
                                             "code": "model_not_found"}


def test_sampled_requests_pass_their_settings_on(client):
    body = {"prompt": STORY, "max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": 7}
    first, second = (client.post("/v1/completions", json=body).json() for _ in range(2))
    assert first["cats"]["temperature"] == 0.9
    assert first["choices"][0]["text"] == second["choices"][0]["text"]  # the same seed, the same text
    assert client.post("/v1/completions", json={"prompt": STORY, "max_tokens": 2}).json()["cats"]["temperature"] == 1.0


def test_queue_full_429_and_disconnects_free_the_slot(server, client, model):
    """A long answer holds the slot, one request waits, the next gets 429; dropping the long answer's connection
    cancels it, a queued client that leaves gives up its place, and the waiting request is served."""
    before = health(client)
    long_body = {"prompt": STORY, "max_tokens": 1900, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(base_url=server, timeout=60) as first:
        with first.stream("POST", "/v1/completions", json=long_body) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # decoding has started: the slot is taken
            assert health(client)["busy"]

            # a queued client that disconnects leaves the queue
            with raw_post(server, "/v1/completions", {"prompt": STORY, "max_tokens": 5}):
                wait_for(lambda: health(client)["queued"] == 1)
            wait_for(lambda: health(client)["queued"] == 0)

            waiting = {}
            thread = threading.Thread(target=lambda: waiting.update(
                response=httpx.post(f"{server}/v1/completions", json={"prompt": STORY, "max_tokens": 8,
                                                                        "temperature": 0}, timeout=60)))
            thread.start()
            wait_for(lambda: health(client)["queued"] == 1)

            refused = client.post("/v1/completions", json={"prompt": STORY, "max_tokens": 8})
            assert refused.status_code == 429
            assert int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["code"] == "queue_full"
        # leaving the with-block closed the streaming connection mid-answer
    thread.join(timeout=60)
    served = waiting["response"]
    assert served.status_code == 200 and served.json()["cats"]["queue_s"] > 0
    assert served.json()["choices"][0]["text"] == greedy_text(model, model.tokenizer(STORY)["input_ids"], 8)
    wait_for(lambda: not health(client)["busy"])
    after = health(client)
    assert after["cancelled"] == before["cancelled"] + 1 and after["queued"] == 0
    assert after["completed"] == before["completed"] + 1


def raw_post(server, path, body) -> socket.socket:
    """Send a request on a raw socket (httpx would wait for the response); the caller closes it to leave."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1])))
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (path.encode(), len(payload), payload))
    return sock


def test_a_client_that_leaves_a_non_streamed_answer_cancels_it(server, client):
    before = health(client)
    with raw_post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": STORY}],
                                                   "max_tokens": 1900, "ignore_eos": True}):
        wait_for(lambda: health(client)["busy"])
    wait_for(lambda: not health(client)["busy"])
    assert health(client)["cancelled"] == before["cancelled"] + 1


def test_openai_client(server, model):
    openai = pytest.importorskip("openai", reason="the openai package is not installed")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="not-needed")
    assert [m.id for m in client.models.list()] == ["stories"]
    messages = [{"role": "user", "content": STORY}]
    answer = client.chat.completions.create(model="stories", messages=messages, max_tokens=20, temperature=0)
    assert answer.choices[0].message.content == greedy_text(model, chat_ids(model), 20)
    assert answer.usage.completion_tokens == 20 and answer.model_extra["cats"]["method"] == "pld"
    stream = client.chat.completions.create(model="stories", messages=messages, max_tokens=20, temperature=0,
                                            stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == answer.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt=STORY, max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="stories", prompt=STORY, max_tokens=4, extra_body={"tools": []})


def test_a_server_under_a_memory_budget_answers_as_plain_decoding_within_the_context_it_planned(model_dir, model,
                                                                                               tmp_path, monkeypatch):
    """Under a budget part of the model streams, answers are still plain greedy decoding's, and a request longer than
    the KV cache the plan reserved is refused up front with an OpenAI-shaped 400 naming --max-context."""
    from cats import MemoryConfig
    from cats.api import prepare

    monkeypatch.setenv("CATS_CACHE", str(tmp_path / "cache"))  # its layer store
    budgeted = prepare(str(model_dir), "pld", None, MemoryConfig(budget="1.5MiB"), context_tokens=64)
    assert budgeted.memory_plan.streamed and budgeted.usable_context == 64 < budgeted.context_length
    prompt = chat_ids(model)
    with live_server(budgeted) as base, httpx.Client(base_url=base, timeout=60) as client:
        card = client.get("/v1/models").json()["data"][0]["cats"]
        assert card["context_length"] == 64 and card["memory_plan"]["streamed_layers"]
        response = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": STORY}], "max_tokens": 24, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == greedy_text(model, prompt, 24)
        assert response.json()["cats"]["offload"]["acquires"] > 0  # the streamed layers were read
        rest = client.post("/v1/chat/completions", json={  # no max_tokens: up to the planned context
            "messages": [{"role": "user", "content": STORY}], "temperature": 0, "ignore_eos": True})
        assert rest.json()["usage"]["total_tokens"] == 64, rest.text
        refused = client.post("/v1/completions", json={"prompt": STORY, "max_tokens": 64})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
        assert "maximum context length is 64 tokens" in error["message"] and "--max-context" in error["message"]
    budgeted.close()


def test_cats_serve_plans_its_memory_budget_for_max_context_tokens(model_dir, tmp_path, monkeypatch, capsys):
    """`cats serve --memory-budget` loads the model under the budget, planned for --max-context tokens a request;
    --max-context without a budget is refused, not ignored."""
    import cats.api
    from cats.cli import main
    from cats.cli import serve as serve_command

    served = {}

    class Recorded:  # stands in for the HTTP server: records what it would serve
        def __init__(self, app, engine, **settings):
            served.update(engine=engine, settings=settings)

        def run(self):
            served["ran"] = True

    monkeypatch.setattr(serve_command, "GracefulServer", Recorded)
    monkeypatch.setattr(cats.api, "anonymous_rss_bytes", lambda: 300 << 20)  # the process's runtime, fixed
    monkeypatch.setenv("CATS_CACHE", str(tmp_path / "cache"))
    base = ["serve", "--model", str(model_dir), "--method", "pld", "--port", "0"]
    assert main(base + ["--max-context", "64"]) == 2
    assert "--max-context applies with --memory-budget only" in capsys.readouterr().err
    assert main(base + ["--memory-budget", "1.5MiB+332MiB", "--max-context", "4096"]) == 2 and not served
    assert "longer than the model's context window of 2048 tokens" in capsys.readouterr().err
    assert main(base + ["--memory-budget", "1.5MiB+332MiB", "--max-context", "64"]) == 0 and served["ran"]
    model = served["engine"].model
    assert model.memory_plan.streamed and model.usable_context == 64
    err = capsys.readouterr().err
    assert "memory plan: budget" in err and "64 tokens of context a request" in err
    model.close()


def test_cats_serve_process_shuts_down_cleanly_on_sigterm(model_dir):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "cats.cli", "serve", "--model", str(model_dir), "--port", str(port),
                             "--method", "ar", "--shutdown-timeout", "0.5", "--threads", "1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300  # generous: a loaded 2-core machine imports slowly
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "cats serve did not come up"
                time.sleep(0.2)
        assert httpx.get(f"{base}/v1/models", timeout=60).json()["data"][0]["id"] == model_dir.name
        answer = httpx.post(f"{base}/v1/completions", json={"prompt": STORY, "max_tokens": 6, "temperature": 0},
                            timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 6
        # SIGTERM with an answer in flight: it may go on for --shutdown-timeout, then ends with an error event
        with httpx.stream("POST", f"{base}/v1/completions", timeout=30,
                          json={"prompt": STORY, "max_tokens": 1900, "ignore_eos": True, "stream": True}) as stream:
            received = events(_signal_after_first_line(stream, proc))
        started = time.monotonic()
        assert received[-1] == "[DONE]" and received[-2]["error"]["code"] == "shutting_down"
        assert len(received) > 3 and "choices" in received[-3]
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - started < 60
        log = proc.stdout.read()
        assert "Shutting down" in log and "Finished server process" in log, log
        assert "Traceback" not in log and "ERROR" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class _signal_after_first_line:
    """A streamed response whose server gets SIGTERM once the first event has arrived."""

    def __init__(self, stream, proc):
        self.stream, self.proc = stream, proc

    def iter_lines(self):
        for number, line in enumerate(self.stream.iter_lines()):
            if number == 1:
                self.proc.send_signal(signal.SIGTERM)
            yield line
