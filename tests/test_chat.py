"""`cats chat`: streamed answers over a history, /reset, the statistics line, the context window."""

from __future__ import annotations

import io
import sys

import pytest

from cats.cli.chat import Chat
from cats.draft import PromptLookupDrafter
from cats.config import GenerationConfig
from cats.loop.generator import Generator
from cats.prompts import encode_chat


@pytest.fixture(scope="module")
def model(stories_chat_dir):
    import cats

    return cats.load_model(str(stories_chat_dir))


def greedy_answer(model, messages, max_new_tokens):
    ids = encode_chat(model, messages)
    return Generator(model).generate(ids, GenerationConfig(max_new_tokens=max_new_tokens)).text


def test_answers_see_the_history_and_reset_forgets_it(model):
    conversation = Chat(Generator(model, PromptLookupDrafter()), system="Tell stories.", max_new_tokens=20)
    system = [{"role": "system", "content": "Tell stories."}]
    streamed = []
    first, stats = conversation.answer("Once upon a time", streamed.append)
    history = [{"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": first}]
    assert "".join(streamed) == first == greedy_answer(model, system + history[:1], 20)
    assert stats.method == "pld" and stats.new_tokens == 20 and stats.mean_accepted >= 1
    assert conversation.history == history

    second, _ = conversation.answer("The dog", lambda _: None)
    assert second == greedy_answer(model, system + history + [{"role": "user", "content": "The dog"}], 20)
    conversation.reset()
    assert conversation.history == []
    assert conversation.answer("The dog", lambda _: None)[0] == greedy_answer(
        model, system + [{"role": "user", "content": "The dog"}], 20)


def test_old_turns_are_dropped_to_fit_the_context_window(stories_chat_dir):
    import cats

    model = cats.load_model(str(stories_chat_dir))
    model.config.max_position_embeddings = 80  # a small context window
    conversation = Chat(Generator(model), max_new_tokens=20)
    for _ in range(4):
        conversation.answer("Once upon a time there was a cat", lambda _: None)
        assert len(encode_chat(model, conversation.messages())) < 80
    assert conversation.dropped >= 2 and conversation.history[-2]["role"] == "user"


def test_interrupted_answer_is_taken_back(model):
    conversation = Chat(Generator(model), max_new_tokens=20)

    def interrupt(_):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        conversation.answer("Once upon a time", interrupt)
    assert conversation.history == []


def test_cats_chat_command(stories_chat_dir, model, monkeypatch, capsys):
    from cats.cli import main

    monkeypatch.setattr(sys, "stdin", io.StringIO("Once upon a time\n/help\n/reset\nOnce upon a time\n/exit\nnever\n"))
    assert main(["chat", "--model", str(stories_chat_dir), "--max-new-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    answer = greedy_answer(model, [{"role": "user", "content": "Once upon a time"}], 12)
    assert out == f"{answer}\n{answer}\n"  # after /reset the same question gets the same answer
    stats = [line for line in err.splitlines() if line.startswith("[pld] ")]
    assert len(stats) == 2 and all("12 tokens" in s and "tok/s" in s and "mean accepted" in s for s in stats)
    assert "(history cleared)" in err and "unknown command /help" in err


def test_under_a_memory_budget_the_history_fits_the_planned_context(stories_chat_dir, model, tmp_path, monkeypatch,
                                                                     capsys):
    """`cats chat --memory-budget --max-context 80`: part of the model streams, the answers are plain greedy
    decoding's, and old turns are dropped to fit the 80 tokens the plan reserved (the model's window is 512)."""
    import cats.api
    from cats.cli import main
    from cats.cli import chat as chat_command

    monkeypatch.setattr(cats.api, "anonymous_rss_bytes", lambda: 300 << 20)  # the process's runtime, fixed
    monkeypatch.setenv("CATS_CACHE", str(tmp_path / "cache"))  # its layer store
    conversations = []
    monkeypatch.setattr(chat_command, "Chat", lambda *a, **k: conversations.append(Chat(*a, **k)) or conversations[-1])
    monkeypatch.setattr(sys, "stdin", io.StringIO("Once upon a time there was a cat\n" * 4))
    assert main(["chat", "--model", str(stories_chat_dir), "--max-new-tokens", "20", "--memory-budget",
                 "1.8MiB+332MiB", "--max-context", "80"]) == 0
    out, err = capsys.readouterr()
    conversation = conversations[0]
    budgeted = conversation.model
    assert budgeted.memory_plan.streamed and budgeted.usable_context == 80 < budgeted.context_length
    assert "memory plan: budget" in err and conversation.dropped >= 2
    first = greedy_answer(model, [{"role": "user", "content": "Once upon a time there was a cat"}], 20)
    assert out.startswith(first + "\n")
    assert len(encode_chat(budgeted, conversation.messages())) < 80
    assert main(["chat", "--model", str(stories_chat_dir), "--max-context", "80"]) == 2  # not ignored without a budget
    assert "--max-context applies with --memory-budget only" in capsys.readouterr().err
    budgeted.close()
