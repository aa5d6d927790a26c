"""The model a long-lived command (``cats serve``, ``cats chat``) loads once for requests whose lengths it cannot
know: in memory, or under ``--memory-budget`` planned for ``--max-context`` tokens a request, a prompt that long
included (`cats.model.LayeredModel.usable_context` is then the planned context)."""

from __future__ import annotations

import argparse
import sys

from cats.api import load, prepare
from cats.cli.args import (
    add_memory_arguments,
    check_memory_flags,
    checked_context_window,
    integer,
    load_settings,
    memory_from_args,
)
from cats.errors import InvalidArgumentError
from cats.model import LayeredModel
from cats.model.source import load_tokenizer


def add_session_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """``--memory-budget``, ``--prefetch``, ``--offload-io`` and ``--max-context``."""
    add_memory_arguments(parser)
    parser.add_argument("--max-context", type=integer, default=None,
                        help="with --memory-budget: tokens of KV cache to plan for, the most one request's prompt and "
                        "answer may hold together (default: 2048, or the model's context window if shorter); the plan "
                        "also reserves a prompt of this length")


def load_for_session(args) -> LayeredModel:
    """The model of ``args`` (``--model`` or the default), loaded as its kernel, method and memory arguments ask;
    under a budget the plan is printed to stderr. Bad settings fail before anything loads."""
    source, method, drafting, kernels = load_settings(args)
    if args.memory_budget is None:
        check_memory_flags(args)
        return load(source, kernels)
    if args.max_context is not None and args.max_context < 2:
        raise InvalidArgumentError(f"--max-context must be at least 2 tokens (a prompt and an answer), got "
                                   f"{args.max_context}")
    if args.max_context is not None:
        checked_context_window(source, args.max_context)
    memory = memory_from_args(args)
    memory.validate()
    model = prepare(source, method, drafting, memory, kernels, context_tokens=args.max_context,
                    tokenizer=load_tokenizer(source))
    print(model.memory_plan.describe(), file=sys.stderr)
    return model
