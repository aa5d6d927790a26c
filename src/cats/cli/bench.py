"""The ``cats bench`` subcommand: ``cats bench --model M --questions FILE --methods LIST --out DIR`` runs a
benchmark; ``cats bench equal A.jsonl B.jsonl`` compares two answer files (exit 0 equal, 1 not)."""

from __future__ import annotations

import argparse
from pathlib import Path

from cats.bench.catalog import known_methods, parse_methods
from cats.bench.curve import CURVE_PLOT, CURVE_REPORT, run_curve
from cats.bench.equal import compare_answers
from cats.bench.methods import (
    MethodSettings,
    SamplingSettings,
)
from cats.bench.prompts import PROMPT_FORMATS
from cats.bench.runner import TURN_MODES, BenchConfig, run_bench
from cats.cli.args import (
    add_memory_arguments,
    add_model_arguments,
    add_pack_argument,
    add_sampling_arguments,
    add_sparsity_argument,
    add_tree_arguments,
    check_memory_flags,
    integer,
)
from cats.errors import InvalidArgumentError
from cats.paths import default_model

DEFAULT_METHODS = "ar,hf-ar,hf-pld,hf-early-exit,pld,early-exit"


def add_bench_parser(subparsers) -> None:

    bench = subparsers.add_parser(
        "bench", help="benchmark methods and baselines on Spec-Bench / MT-Bench questions",
        description="Run every method on the same questions in one process (after a warm-up, methods interleaved "
                    "per question) and write DIR/<method>.jsonl (Spec-Bench answer format), summary.json, report.md "
                    "and PNG plots. 'cats bench equal A.jsonl B.jsonl' compares two answer files.",
    )
    add_model_arguments(bench)
    bench.add_argument("--questions", type=Path, help="question file (.jsonl with question_id, category, turns)")
    bench.add_argument("--out", type=Path, help="output folder")
    bench.add_argument("--methods", default=DEFAULT_METHODS,
                       help=f"comma-separated methods (default: {DEFAULT_METHODS}); known: {', '.join(known_methods())}")
    bench.add_argument("--limit", type=integer, default=None, help="only the first N selected questions")
    bench.add_argument("--per-category", type=integer, default=None,
                       help="only the first N questions of each category (a stratified subset)")
    bench.add_argument("--turns", choices=TURN_MODES, default="first", help="first turn only (default) or all turns")
    bench.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="chat",
                       help="chat: apply the chat template (default); raw: plain text, for models without one")
    bench.add_argument("--max-new-tokens", type=integer, default=256)
    add_pack_argument(bench)
    add_sampling_arguments(bench)  # --temperature --top-p --top-k --seed --acceptance --typical-tau --typical-alpha
    bench.add_argument("--warmup", type=integer, default=1, help="warm-up runs per method (default 1)")
    bench.add_argument("--num-draft-tokens", "-k", type=integer, default=None,
                       help="tokens drafted per step, for pld/early-exit and their baselines (default: pld 10, "
                            "early-exit 4)")
    bench.add_argument("--draft-layer", type=integer, default=None,
                       help="early-exit layer, for early-exit and hf-early-exit (default: depth/8)")
    bench.add_argument("--max-ngram", type=integer, default=3,
                       help="longest n-gram prompt lookup matches, for pld and its baselines")
    bench.add_argument("--adapters", default=None,
                       help="trained adapters folder (e.g. adapters/smollm2-135m-instruct): early-exit drafts through "
                            "its draft adapter")
    bench.add_argument("--threshold", type=float, default=None,
                       help="confidence stop of CATS early-exit, eagle, tree, cats and layer-skip (default 0.4; 0 = "
                       "never stop, layer-skip's default)")
    add_tree_arguments(bench)
    add_sparsity_argument(bench)
    add_memory_arguments(bench)
    bench.add_argument("--memory-limit", default=None, metavar="LIMIT[,LIMIT...]",
                       help="run each method in its own Linux memory cgroup with this limit, page cache included "
                       "(e.g. 917MiB, 50%%+384MiB: percentages of the model's bytes in the format it runs in); ours "
                       "plan for it as their process budget; llama-server and hf-offload run under it too. Several "
                       "limits (25%%+384MiB,50%%+384MiB,...) run the benchmark once per limit and plot tokens/s "
                       "against the limit (OUT/memory_curve.png)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(run=run_bench_command)

    actions = bench.add_subparsers(dest="bench_action", metavar="equal")
    equal = actions.add_parser("equal", help="are two answer files token-for-token equal? (exit 0 yes, 1 no)")
    equal.add_argument("first", type=Path)
    equal.add_argument("second", type=Path)
    equal.set_defaults(run=run_equal_command)


def run_bench_command(args: argparse.Namespace) -> int:

    for flag, value in (("--questions", args.questions), ("--out", args.out)):
        if value is None:
            raise InvalidArgumentError(f"cats bench needs {flag}")
    limits = [text.strip() for text in (args.memory_limit or "").split(",") if text.strip()]
    if args.memory_limit is not None and not limits:
        raise InvalidArgumentError("--memory-limit is empty: pass a limit such as 917MiB or 50%+384MiB")
    if args.memory_budget is None and not limits:
        check_memory_flags(args)
    config = BenchConfig(
        model=args.model or default_model(), questions=args.questions, out=args.out,
        methods=parse_methods(args.methods), max_new_tokens=args.max_new_tokens, dtype=args.dtype,
        threads=args.threads, turns=args.turns, prompt_format=args.prompt_format, limit=args.limit,
        per_category=args.per_category, warmup=args.warmup,
        settings=MethodSettings(num_draft_tokens=args.num_draft_tokens, draft_layer=args.draft_layer,
                                max_ngram=args.max_ngram, adapters=args.adapters, threshold=args.threshold,
                                tree_topk=args.tree_topk, total_tokens=args.total_tokens, depth=args.depth,
                                sv_threshold=args.sv_threshold, sv_passes=args.sv_passes, sparsity=args.sparsity,
                                sampling=SamplingSettings(args.temperature, args.top_p, args.top_k, args.acceptance,
                                                          args.typical_tau, args.typical_alpha)),
        seed=args.seed,
        progress=not args.no_progress, memory_budget=args.memory_budget, pack_weights=args.pack_weights,
        memory_limit=limits[0] if len(limits) == 1 else None,
        kernels=args.kernels,
        prefetch=args.prefetch, offload_io=args.offload_io or "direct",
    )
    config.validate()  # before the model loads
    if len(limits) > 1:
        curve = run_curve(config, limits)
        for point in curve["points"]:
            print(f"limit {point['limit']} ({point['limit_mb']:.0f} MiB): " + ", ".join(
                f"{name} {speed:.2f} tok/s" for name, speed in point["methods"].items() if speed is not None))
        print(f"wrote {args.out}/{CURVE_REPORT}, {CURVE_PLOT} and one folder per limit")
        return 0
    summary = run_bench(config)
    print(f"acceptance: {summary['acceptance']}, temperature {summary['temperature']:g}")
    for name, method in summary["methods"].items():
        speedup = f"{method['speedup']:.2f}x" if method["speedup"] is not None else "–"
        tokens_per_s = f"{method['tokens_per_s']:.1f}" if method["tokens_per_s"] is not None else "–"
        accepted = f"{method['mean_accepted']:.2f}" if method["mean_accepted"] is not None else "–"
        print(f"{name:>16}: {tokens_per_s} tok/s, speedup {speedup}, mean accepted {accepted}, "
              f"acceptance: {method['acceptance']}, failures {method['failures']}")
    for name, reason in summary["skipped"].items():
        print(f"{name:>16}: skipped ({reason})")
    if summary.get("memory_limit"):
        print(f"memory limit {summary['memory_limit']} = {summary['memory_limit_mb']:.1f} MiB (a cgroup each); "
              "peak charged: " + ", ".join(f"{name} {m['peak_memory_mb']:.0f} MiB" for name, m in
                                           summary["methods"].items() if m.get("peak_memory_mb") is not None))
    elif summary.get("memory_budget"):
        print(f"memory budget {summary['memory_budget']} = {summary['memory_budget_mb']:.1f} MiB, runtime baseline "
              f"{summary['runtime_baseline_mb']:.1f} MiB; peak RSS: " + ", ".join(
                  f"{name} {m['peak_rss_mb']:.0f} MiB" for name, m in summary["methods"].items()))
    print(f"wrote {args.out}/summary.json and report.md")
    return 0


def run_equal_command(args: argparse.Namespace) -> int:

    comparison = compare_answers(str(args.first), str(args.second))
    if comparison.equal:
        print(f"equal: {comparison.questions} questions, token for token")
        return 0
    print(f"not equal: {comparison.difference}")
    return 1
