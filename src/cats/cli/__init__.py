"""The ``cats`` command line: ``cats generate``, ``chat``, ``bench``, ``train``, ``export``, ``calibrate`` and ``serve``. Each
command parses its arguments here and calls the API below it.

Errors print one line and no traceback: a user or input error (a `CatsError`: bad argument, missing or damaged
file) ``cats: error: <message>`` with exit status 2; anything else ``cats: error: <type>: <message> (run with
--debug for the traceback)`` with exit status 1. ``cats --debug <command>`` prints the traceback as well."""

from __future__ import annotations

import argparse
import sys
import traceback

from cats.api import quiet_transformers, set_threads
from cats.cli.bench import add_bench_parser
from cats.cli.calibrate import add_calibrate_parser
from cats.cli.chat import add_chat_parser
from cats.cli.export import add_export_parser
from cats.cli.generate import add_generate_parser
from cats.cli.serve import add_serve_parser
from cats.cli.train import add_train_parser
from cats.errors import CatsError, NoTokenizerError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cats", description="CATS: lossless self-speculative decoding")
    parser.add_argument("--debug", action="store_true", help="on an error, print the Python traceback too")
    commands = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(commands)
    add_calibrate_parser(commands)
    add_bench_parser(commands)
    add_train_parser(commands)
    add_export_parser(commands)
    add_serve_parser(commands)
    add_chat_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    quiet_transformers()
    try:
        if getattr(args, "threads", None) is not None:
            set_threads(args.threads)
        return args.run(args)
    except KeyboardInterrupt:
        print("cats: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # every failure: one line; the traceback only with --debug
        if args.debug:
            traceback.print_exc()
        print(f"cats: error: {error_line(error)}", file=sys.stderr)
        return 2 if isinstance(error, CatsError) else 1


def error_line(error: Exception) -> str:
    """The one line the command line prints for ``error``."""
    if isinstance(error, NoTokenizerError):  # the API's advice (pass token ids) is not open to a command
        return (f"model {str(error.model)!r} has no tokenizer CATS can read, so a text prompt cannot be turned into "
                "tokens; use a model folder with its tokenizer files (tokenizer.json, tokenizer_config.json) or a "
                "GGUF file whose metadata holds a tokenizer transformers can read")
    if isinstance(error, CatsError):
        return str(error)
    lines = str(error).strip().splitlines()
    text = lines[0] + (" ..." if len(lines) > 1 else "") if lines else "(no message)"
    return f"{type(error).__name__}: {text} (run with --debug for the traceback)"
