"""``cats serve``: load a model once and serve it over an OpenAI-compatible HTTP API (uvicorn).

SIGTERM (and Ctrl-C) shut down gracefully (`cats.serve.server`): no new requests, a running answer gets
``--shutdown-timeout`` seconds to finish and is then cancelled; after SIGTERM the process exits with status 0."""

from __future__ import annotations

import importlib.util
import signal
import sys
from pathlib import Path

from cats.cli.args import add_method_arguments, add_model_arguments, add_pack_argument, build_generator, integer
from cats.cli.session import add_session_memory_arguments, load_for_session
from cats.errors import InvalidArgumentError, MissingDependencyError, NoTokenizerError
from cats.paths import default_model
from cats.serve.engine import Engine

SERVE_PACKAGES = ("fastapi", "uvicorn", "pydantic")  # the 'serve' extra
SERVE_MISSING = [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]
if not SERVE_MISSING:  # the server's modules import those packages: without them, `cats serve` says what to install
    from cats.serve.app import create_app
    from cats.serve.server import GracefulServer


def add_serve_parser(commands) -> None:

    serve = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API (chat and text completions, streaming)",
        description="Serve one model over OpenAI's /v1/chat/completions, /v1/completions and /v1/models, plus "
                    "/health; one decode at a time, later requests queue in arrival order. Needs the serve extra: "
                    "pip install 'cats[serve]'.",
    )
    add_model_arguments(serve)
    add_pack_argument(serve)
    add_method_arguments(serve, default="pld")
    add_session_memory_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine "
                       "only; 0.0.0.0 for every interface)")
    serve.add_argument("--port", type=integer, default=8000, help="port (default: 8000; 0 picks a free one)")
    serve.add_argument("--max-queue", type=integer, default=8,
                       help="requests that may wait while one decodes; more are refused with HTTP 429 (default: 8)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model's name in the API (default: the model folder's or file's name)")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="on SIGTERM, seconds a running answer may take to finish before it is cancelled")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's log level (default: info)")
    serve.set_defaults(run=run_serve)


def served_name(model: str) -> str:
    """The API name of a model: a local path's last component (without .gguf), or the Hub id itself."""
    path = Path(model)
    if path.exists():
        return path.stem if path.suffix == ".gguf" else path.resolve().name
    return model


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)


def run_serve(args) -> int:
    if SERVE_MISSING:
        raise MissingDependencyError(f"cats serve needs {', '.join(SERVE_PACKAGES)} (missing: "
                                     f"{', '.join(SERVE_MISSING)}): pip install 'cats[serve]'")

    if not 0 <= args.port <= 65535:
        raise InvalidArgumentError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue < 0:
        raise InvalidArgumentError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.shutdown_timeout < 0:
        raise InvalidArgumentError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout:g}")
    model_path = args.model or default_model()
    model = load_for_session(args)
    if model.tokenizer is None:
        raise NoTokenizerError(f"model {model_path!r} has no tokenizer that transformers can read; "
                               "cats serve needs one to turn text into tokens", model_path)
    generator = build_generator(args, model)
    name = args.served_model_name or served_name(model_path)
    engine = Engine(generator, max_queue=args.max_queue)
    server = GracefulServer(create_app(engine, name), engine, grace_s=args.shutdown_timeout, host=args.host,
                            port=args.port, log_level=args.log_level)
    budget = (f", under a memory budget of {model.memory_plan.budget / 2**20:.0f} MiB, {model.usable_context} tokens "
              "of context a request" if model.memory_plan is not None else "")
    print(f"cats: serving {name!r} with method {generator.method}{budget} on http://{args.host}:{args.port}/v1 "
          "(POST /v1/chat/completions, /v1/completions; GET /v1/models, /health)", file=sys.stderr, flush=True)
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again: exit 0 then, not "killed by SIGTERM"
    signal.signal(signal.SIGTERM, _exit_cleanly)
    server.run()
    return 0
