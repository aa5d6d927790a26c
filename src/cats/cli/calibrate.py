"""``cats calibrate``: find and cache the sublayers layer-skip drafting skips (`cats.draft.layer_skip.calibration`),
or with ``--stream-order`` the whole layers a memory budget streams first (`cats.draft.layer_skip.stream_order`)."""

from __future__ import annotations

from pathlib import Path

from cats.cli.args import add_model_arguments, integer, sparsities
from cats.draft.layer_skip.calibration import (
    DEFAULT_SPARSITIES,
    calibrate,
    skip_set_file,
)
from cats.draft.layer_skip.stream_order import WIDTH, calibrate_stream_order
from cats.errors import InvalidArgumentError
from cats.model import load_model
from cats.model.identity import model_fingerprint
from cats.model.weights.stream_order import stream_order_file
from cats.paths import default_model


def add_calibrate_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="find and cache the sublayers layer-skip drafting skips",
        description="Search, per sparsity, the attention/MLP sublayers whose skipping keeps the model's greedy "
                    "predictions most often (teacher-forced on its own continuations of calibration prompts) and "
                    "cache the result in $CATS_CACHE/skip-sets/. layer-skip and dytc use the cached skip sets. With "
                    "--stream-order: order whole layers so that the first n of them are the n layers a skip draft "
                    "does best without, for every n, and cache it in $CATS_CACHE/stream-orders/; under a memory "
                    "budget layer-skip and dytc then stream those layers and draft from the resident ones alone.")
    add_model_arguments(parser)
    parser.add_argument("--sparsity", type=sparsities, default=None,
                        help="comma-separated fractions of sublayers to skip (default 0.4,0.6)")
    parser.add_argument("--stream-order", action="store_true",
                        help="calibrate the order in which a memory budget streams whole layers instead of skip sets")
    parser.add_argument("--length", type=integer, default=None,
                        help="with --stream-order: layers in the order (default all but layer 0)")
    parser.add_argument("--width", type=integer, default=WIDTH,
                        help=f"with --stream-order: candidate layers tried per step (default {WIDTH})")
    parser.add_argument("--prompts", default=None, help="prompt file: ShareGPT JSON or question JSON lines "
                        "(default: ../shared/data's ShareGPT sample when present, else built-in prompts)")
    parser.add_argument("--num-prompts", type=integer, default=8, help="prompts used (default 8)")
    parser.add_argument("--tokens", type=integer, default=32, help="greedy continuation tokens per prompt (default 32)")
    parser.add_argument("--budget", type=integer, default=None,
                        help="local-search evaluations per sparsity (default 200)")
    parser.add_argument("--seed", type=integer, default=0)
    parser.add_argument("--force", action="store_true", help="recalibrate even if a matching cached result exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run_calibrate_command)


def run_calibrate_command(args) -> int:
    if args.stream_order:
        return _stream_order(args)
    if args.length is not None:
        raise InvalidArgumentError("--length applies to --stream-order")
    args.sparsity = args.sparsity or DEFAULT_SPARSITIES
    args.budget = 200 if args.budget is None else args.budget
    for sparsity in args.sparsity:
        if not 0.0 < sparsity < 1.0:
            raise InvalidArgumentError(f"sparsity must lie in (0, 1), got {sparsity:g}")
    if args.prompts is not None and not Path(args.prompts).is_file():
        raise InvalidArgumentError(f"prompt file {args.prompts!r} does not exist")
    model = load_model(args.model or default_model(), dtype=args.dtype, kernels=args.kernels)
    results = calibrate(model, args.sparsity, prompt_source=args.prompts, tokens=args.tokens, budget=args.budget,
                        seed=args.seed, num_prompts=args.num_prompts, force=args.force, progress=not args.no_progress)
    total = 2 * model.num_layers
    for result in results:
        skip = result.skip
        print(f"sparsity {result.sparsity:g}: skip {skip.size} of {total} sublayers, attention {list(skip.attention)}, "
              f"mlp {list(skip.mlp)}; agreement with the full model {result.agreement:.3f} "
              f"({result.evaluations} sets scored in {result.seconds:.1f} s, prompts: {result.settings.prompts})")
    print(f"cached in {skip_set_file(model)}")
    return 0


def _stream_order(args) -> int:
    if args.sparsity is not None or args.budget is not None or args.force or args.seed:
        raise InvalidArgumentError("--sparsity, --budget, --seed and --force apply to skip sets, not to "
                                   "--stream-order (which always calibrates anew)")
    if args.prompts is not None and not Path(args.prompts).is_file():
        raise InvalidArgumentError(f"prompt file {args.prompts!r} does not exist")
    model = load_model(args.model or default_model(), dtype=args.dtype, kernels=args.kernels)
    order = calibrate_stream_order(model, args.length, prompt_source=args.prompts, tokens=args.tokens,
                                   num_prompts=args.num_prompts, width=args.width, progress=not args.no_progress)
    print(f"stream order of {len(order.layers)} of {model.num_layers} layers "
          f"({order.settings['evaluations']} sets scored in {order.settings['seconds']:.1f} s, prompts: "
          f"{order.settings['prompts']}):")
    for count in range(1, len(order.layers) + 1):
        print(f"  {count:2d} streamed: layers {list(order.skipped(count))}, skip-draft agreement "
              f"{order.agreement_at(count):.3f}")
    print(f"cached in {stream_order_file(model_fingerprint(model))}")
    return 0
