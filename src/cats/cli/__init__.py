"""The ``cats`` command line: ``cats generate``, ``chat``, ``bench``, ``train``, ``calibrate`` and ``serve``. Each
command parses its arguments here and calls the API below it.

User errors print one line, ``cats: error: ...``, and exit with status 2; no traceback."""

from __future__ import annotations

import argparse
import sys

from cats.api import quiet_transformers, set_threads
from cats.cli.bench import add_bench_parser
from cats.cli.calibrate import add_calibrate_parser
from cats.cli.chat import add_chat_parser
from cats.cli.generate import add_generate_parser
from cats.cli.serve import add_serve_parser
from cats.cli.train import add_train_parser
from cats.errors import CatsError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cats", description="CATS: lossless self-speculative decoding")
    commands = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(commands)
    add_calibrate_parser(commands)
    add_bench_parser(commands)
    add_train_parser(commands)
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
    except CatsError as error:
        print(f"cats: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cats: interrupted", file=sys.stderr)
        return 130

