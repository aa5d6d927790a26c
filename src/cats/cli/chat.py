"""``cats chat``: an interactive terminal chat with streamed answers, a history, ``/reset``, and a statistics
line (tokens/s, mean accepted tokens) after every answer."""

from __future__ import annotations

import sys
from collections.abc import Callable

from cats.cli.args import add_method_arguments, add_model_arguments, add_pack_argument, build_generator, integer
from cats.cli.session import add_session_memory_arguments, load_for_session
from cats.config import request_config
from cats.errors import InvalidArgumentError, NoTokenizerError, PromptTooLongError
from cats.loop.generator import Generator
from cats.loop.stats import GenerationStats
from cats.loop.text import IncrementalDetokenizer
from cats.prompts import encode_chat

HELP = "/reset clears the history, /exit (or Ctrl-D) quits, Ctrl-C stops an answer"


class Chat:
    """A conversation with one model: each answer sees the whole history (oldest turns are dropped when the
    history no longer fits into the context window: the model's, or the context a memory budget planned for).
    ``sampling``: temperature, top_p, seed (default: greedy, as ``cats chat``)."""

    def __init__(self, generator: Generator, system: str | None = None, max_new_tokens: int = 512, **sampling):
        sampling.setdefault("temperature", 0.0)
        self.generator, self.model = generator, generator.model
        self.system, self.max_new_tokens, self.sampling = system, max_new_tokens, sampling
        request_config(max_new_tokens, **sampling)  # fail on bad settings before the first question
        self.history: list[dict] = []
        self.dropped = 0  # messages dropped from the front of the history to fit the context window

    def reset(self) -> None:
        self.history = []

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.history

    def _prompt(self) -> list[int]:
        """The history's token ids, dropping the oldest exchanges until a useful answer fits."""
        context = self.model.usable_context
        while True:
            ids = encode_chat(self.model, self.messages())
            if len(ids) < context - min(self.max_new_tokens, 16) or len(self.history) <= 1:
                break
            self.history = self.history[2:]  # the oldest user message and its answer
            self.dropped += 2
        if len(ids) >= context:
            raise PromptTooLongError(f"the message has {len(ids)} tokens with the chat template; the context "
                                     f"window is {context}: send a shorter one")
        return ids

    def answer(self, text: str, on_text: Callable[[str], None]) -> tuple[str, GenerationStats]:
        """Add ``text`` as the user's message, stream the answer through ``on_text``, keep both in the history.
        If generation is interrupted (Ctrl-C), the unanswered message is taken back out of the history."""
        self.history.append({"role": "user", "content": text})
        stats = GenerationStats()
        try:
            ids = self._prompt()
            config = request_config(min(self.max_new_tokens, self.model.usable_context - len(ids)), **self.sampling)
            detokenizer = IncrementalDetokenizer(self.model.tokenizer)
            for chunk in self.generator.stream(ids, config, stats):
                delta = detokenizer.add(chunk)
                if delta:
                    on_text(delta)
            rest = detokenizer.finish()
            if rest:
                on_text(rest)
        except BaseException:
            self.history.pop()
            raise
        reply = detokenizer.text()
        self.history.append({"role": "assistant", "content": reply})
        return reply, stats


def stats_line(stats: GenerationStats) -> str:
    return (f"[{stats.method}] {stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tok/s, "
            f"mean accepted {stats.mean_accepted:.2f}, stop: {stats.stop_reason}")


def add_chat_parser(commands) -> None:

    chat = commands.add_parser("chat", help="interactive terminal chat with streamed answers",
                               description=f"Chat with a model in the terminal. {HELP}.")
    add_model_arguments(chat)
    add_pack_argument(chat)
    add_method_arguments(chat, default="pld")
    add_session_memory_arguments(chat)
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument("--max-new-tokens", type=integer, default=512, help="longest answer in tokens (default: 512)")
    chat.add_argument("--temperature", type=float, default=0.0,
                      help="0 (default): greedy, the model's exact output; > 0 samples")
    chat.add_argument("--top-p", type=float, default=None, help="nucleus sampling, with --temperature > 0")
    chat.add_argument("--seed", type=integer, default=None, help="sampling seed, with --temperature > 0")
    chat.set_defaults(run=run_chat)


def run_chat(args) -> int:

    sampling = {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}
    request_config(args.max_new_tokens, **sampling)  # fail before the model loads
    model = load_for_session(args)
    if model.tokenizer is None:
        raise NoTokenizerError(f"model {model.name!r} has no tokenizer; cats chat needs one", model.name)
    if not getattr(model.tokenizer, "chat_template", None):
        raise InvalidArgumentError(f"model {model.name!r} has no chat template; cats chat needs one")
    conversation = Chat(build_generator(args, model), system=args.system, max_new_tokens=args.max_new_tokens,
                          **sampling)
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and input history for input())
    print(f"cats chat: {model.name}, method {conversation.generator.method}. {HELP}.", file=sys.stderr, flush=True)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            print(file=sys.stderr)
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            conversation.reset()
            print("(history cleared)", file=sys.stderr, flush=True)
            continue
        if text.startswith("/") and " " not in text:
            print(f"unknown command {text}: {HELP}", file=sys.stderr, flush=True)
            continue
        dropped = conversation.dropped
        try:
            _, stats = conversation.answer(text, lambda delta: print(delta, end="", flush=True))
        except KeyboardInterrupt:
            print("\n(stopped)", file=sys.stderr, flush=True)
            continue
        except PromptTooLongError as error:
            print(f"cats: {error}", file=sys.stderr, flush=True)
            continue
        print(flush=True)
        if conversation.dropped > dropped:
            print(f"(dropped the {conversation.dropped - dropped} oldest messages to fit the context window)",
                  file=sys.stderr)
        print(stats_line(stats), file=sys.stderr, flush=True)
    return 0
