"""``cats generate``: one prompt, the text streamed to stdout."""

from __future__ import annotations

import json
import sys

from cats.api import load, prepare
from cats.cli.args import (
    add_memory_arguments,
    add_method_arguments,
    add_model_arguments,
    add_pack_argument,
    add_sampling_arguments,
    build_generator,
    check_memory_flags,
    checked_context_window,
    integer,
    load_settings,
    memory_from_args,
    sampling_config,
)
from cats.config import GenerationConfig
from cats.errors import InvalidArgumentError
from cats.model.source import load_tokenizer
from cats.prompts import encode_prompt, encode_with
from cats.verify.acceptance import TYPICAL_NEEDS_DRAFTS


def add_generate_parser(commands) -> None:
    gen = commands.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    add_model_arguments(gen)
    gen.add_argument("--prompt", required=True, help="prompt text ('-' reads standard input)")
    gen.add_argument("--chat", action="store_true", help="apply the chat template (prompt = one user message)")
    gen.add_argument("--system", default=None, help="system message, with --chat")
    add_method_arguments(gen)
    add_sampling_arguments(gen)
    add_memory_arguments(gen)
    add_pack_argument(gen)
    gen.add_argument("--max-context", type=integer, default=None, help="with --memory-budget: tokens of KV cache to "
                     "plan for (default: the prompt plus --max-new-tokens)")
    gen.add_argument("--max-new-tokens", type=integer, default=128)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    gen.add_argument("--stats", action="store_true", help="print generation statistics to stderr (with "
                     "--memory-budget: layer streaming counters and peak RSS)")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, "
                     "prompt_token_ids, stats) as the last stdout line")
    gen.set_defaults(run=run_generate)


class TextStreamer:
    """Prints decoded text as tokens arrive, holding back an incomplete multi-byte character."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out, self.ids, self.printed = tokenizer, out or sys.stdout, [], 0

    def __call__(self, tokens: list[int]) -> None:
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        stable = len(text.rstrip("\ufffd"))
        if stable > self.printed:
            self.out.write(text[self.printed : stable])
            self.out.flush()
            self.printed = stable

    def finish(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.out.write(text[self.printed :] + "\n")
        self.out.flush()


def run_generate(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
                              **sampling_config(args))
    config.validate()  # fail on bad arguments before the model loads
    source, method, drafting, kernels = load_settings(args)
    if method == "ar" and config.acceptance == "typical":
        raise InvalidArgumentError(TYPICAL_NEEDS_DRAFTS)
    if args.memory_budget is None:
        check_memory_flags(args)
        model = load(source, kernels)
        prompt_ids = encode_prompt(model, prompt, chat=args.chat, system=args.system)
    else:
        tokenizer = load_tokenizer(source)
        prompt_ids = encode_with(tokenizer, source, prompt, chat=args.chat, system=args.system)
        window = checked_context_window(source, args.max_context)
        wanted = len(prompt_ids) + args.max_new_tokens
        context = args.max_context or (min(wanted, window) if window else wanted)
        memory = memory_from_args(args)
        memory.validate()
        model = prepare(source, method, drafting, memory, kernels,
                        context_tokens=context, tokenizer=tokenizer, prompt_tokens=len(prompt_ids))
        print(model.memory_plan.describe(), file=sys.stderr)
    generator = build_generator(args, model)
    streamer = TextStreamer(model.tokenizer) if model.tokenizer is not None else None
    result = generator.generate(prompt_ids, config, on_tokens=streamer)
    if streamer is not None:
        streamer.finish()
    reason = stop_reason_line(result.stats.stop_reason, config, model)
    if reason:
        print(reason, file=sys.stderr)
    if args.stats:
        print(result.stats.summary_line(), file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict()))
    return 0


def stop_reason_line(reason: str, config: GenerationConfig, model) -> str | None:
    """What stopped a generation, for stderr, unless it was the model's own end of sequence."""
    if reason == "max_new_tokens":
        return f"cats: stopped after --max-new-tokens ({config.max_new_tokens} tokens)"
    if reason == "context_length":
        return (f"cats: stopped: the model's context window ({model.context_length} tokens) is full; shorten the "
                "prompt or use a model with a longer context")
    if reason == "stop_string":
        return "cats: stopped at a --stop string"
    return None

