"""The ``cats`` command line: ``cats generate``, ``bench``, ``train``, ``serve`` and ``chat``.

User errors print one line, ``cats: error: ...``, and exit with status 2; no traceback."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from cats.errors import CatsError, InvalidArgumentError

HUB_DEFAULT = "HuggingFaceTB/SmolLM2-135M-Instruct"
SHARED_DEFAULT = Path("shared") / "data" / "smollm2-135m-instruct-gguf"


def default_model() -> str:
    """SmolLM2-135M-Instruct: the copy in ``../shared/data`` (next to the project or the working directory)
    when there is one, else its Hub id."""
    project_root = Path(__file__).resolve().parents[2]
    for base in (Path.cwd(), project_root):
        candidate = base.parent / SHARED_DEFAULT
        if candidate.is_dir():
            return str(candidate)
    return HUB_DEFAULT


def integer(text: str) -> int:
    """An integer argument; ranges are checked by the API so that the CLI and Python users get the same errors."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help=f"HF folder, .gguf file or Hub id (default: {HUB_DEFAULT}, "
                        "from ../shared/data when present)")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16 or float64")
    parser.add_argument("--threads", type=integer, default=None, help="torch CPU threads")


def add_pack_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pack-weights", action="store_true",
                        help="bfloat16 or float32: run the layers' and lm_head's linears on packed copies of their "
                        "weights, and attention over few tokens, on CATS's row-invariant AVX-512 kernels (compiled "
                        "on first use; oneDNN-prepacked linears where they cannot run): 2.3-2.7x faster plain "
                        "decoding on CPU, and speculative decoding reproduces plain decoding bit for bit in bf16 too; "
                        "outputs differ from unpacked ones in the last bits; costs about the weights' size of extra "
                        "memory; not with --memory-budget")


def add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tree-topk", type=integer, default=None, help="tree/cats/eagle: children per expanded node and "
                        "nodes expanded per depth (1 = a chain; default 4, or chosen from the budget)")
    parser.add_argument("--total-tokens", type=integer, default=None, help="tree/cats/eagle/recycle: nodes kept for "
                        "verification (default 16, or chosen from the budget)")
    parser.add_argument("--depth", type=integer, default=None, help="tree/cats/eagle/recycle: maximum depth (default 5, "
                        "recycle 6, or chosen from the budget)")
    parser.add_argument("--sv-threshold", type=float, default=0.05,  # = cats.cascade.SV_THRESHOLD (a test checks)
                        help="cats: the shallow verifier prunes nodes it gives a probability below this (default 0.05)")
    parser.add_argument("--sv-passes", type=integer, default=1,
                        help="cats: shallow passes per deep pass; each extra one redrafts a chain from the shallow "
                        "verifier's own choice at the end of the path it accepts (default 1)")


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--memory-budget", default=None, metavar="BYTES|PERCENT",
                        help="run under a memory budget (e.g. 300MiB, 1.5GB, 50%% of the weight bytes): embeddings, "
                        "lm_head, the draft layers, adapters, KV cache and activations stay resident, the deep layers "
                        "stream from a per-layer store in $CATS_CACHE/layers (see docs/memory.md)")
    parser.add_argument("--prefetch", type=integer, default=None,
                        help="with --memory-budget: streamed layers read ahead of the one computing (default 2)")
    parser.add_argument("--offload-io", choices=("direct", "buffered"), default=None,
                        help="with --memory-budget: O_DIRECT reads (default) or buffered reads dropped from the page "
                        "cache after each layer")


def sparsities(text: str) -> tuple[float, ...]:
    """``"0.4,0.6"`` -> ``(0.4, 0.6)``; ranges are checked by the API."""
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_sparsity_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sparsity", type=sparsities, default=None,
                        help="layer-skip: fraction of attention/MLP sublayers skipped (default 0.4); dytc: "
                        "comma-separated sparsities of its layer-skip drafters (default 0.4,0.6)")


def add_method_arguments(parser: argparse.ArgumentParser, default: str = "ar") -> None:
    """The decoding method and its drafter's settings (see `build_generator`)."""
    parser.add_argument("--method", default=default, help=f"ar (plain decoding), pld (prompt lookup), early-exit "
                        "(chain), tree (dynamic draft tree from the early exit), cats (draft adapter + tree + "
                        "shallow-verifier cascade; needs --adapters), cats-no-shallow, layer-skip (calibrated "
                        "sublayers skipped), dytc (scheduler over prompt lookup, token recycling, layer skipping and, with "
                        "--adapters, the draft adapter), eagle (trees from the feature draft adapter in --adapters, "
                        "which reads the target's final features; chain: --tree-topk 1), recycle (token recycling: "
                        f"training-free trees from the target's own recent candidates) (default: {default})")
    parser.add_argument("--no-shallow", action="store_true", help="with --method cats: no shallow-verifier cascade")
    parser.add_argument("--draft-layer", type=integer, default=None, help="early-exit layer L_d (default: depth/8)")
    parser.add_argument("--num-draft-tokens", "-k", type=integer, default=None,
                        help="tokens drafted per step (default: pld 10, early-exit 4)")
    parser.add_argument("--max-ngram", type=integer, default=3, help="longest n-gram prompt lookup matches")
    parser.add_argument("--adapters", default=None, help="trained adapters folder (e.g. "
                        "adapters/smollm2-135m-instruct); early-exit then drafts through its draft adapter")
    parser.add_argument("--threshold", type=float, default=None,
                        help="confidence stop: early-exit and layer-skip stop drafting below this draft probability, "
                        "tree, eagle and cats stop expanding below this cumulative path probability (default 0.4 for "
                        "early-exit, eagle, tree and cats; 0 = never stop, layer-skip's default)")
    add_tree_arguments(parser)
    add_sparsity_argument(parser)


def method_from_args(args) -> str:
    """The method name from ``--method`` and ``--no-shallow``; fails on an unknown one before the model loads."""
    from cats.draft import check_method

    check_method(args.method)
    if args.no_shallow:
        if args.method != "cats":
            raise InvalidArgumentError("--no-shallow applies to --method cats only")
        return "cats-no-shallow"
    return args.method


def build_generator(args, model):
    """A `Generator` for ``model`` with the drafter and scorer that the method arguments ask for."""
    from cats.cascade import make_scorer
    from cats.draft import make_drafter
    from cats.generate import Generator

    method = method_from_args(args)
    drafter = make_drafter(method, model, num_draft_tokens=args.num_draft_tokens, draft_layer=args.draft_layer,
                           max_ngram=args.max_ngram, adapters=args.adapters, threshold=args.threshold,
                           tree_topk=args.tree_topk, total_tokens=args.total_tokens, depth=args.depth,
                           sparsity=args.sparsity)
    scorer = make_scorer(method, model, drafter, args.adapters, args.sv_threshold, args.sv_passes)
    return Generator(model, drafter, method=method, scorer=scorer)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """--temperature --top-p --top-k --seed and the acceptance rule (checked by the API, as `GenerationConfig`)."""
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy (default); > 0 samples, and every method keeps plain sampling's distribution")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the most likely tokens up to "
                        "this probability mass (default 1 = off; needs --temperature > 0)")
    parser.add_argument("--top-k", type=integer, default=0, help="keep the K most likely tokens (default 0 = off; "
                        "needs --temperature > 0)")
    parser.add_argument("--seed", type=integer, default=None, help="random seed of a sampled generation (same seed, "
                        "same output; needs --temperature > 0)")
    parser.add_argument("--acceptance", default="exact",
                        help="exact (default: lossless) or typical (Medusa's posterior threshold: LOSSY, faster; "
                        "every report then says 'typical (lossy)')")
    parser.add_argument("--typical-tau", type=float, default=None,
                        help="--acceptance typical: accept a draft token whose target probability exceeds "
                        "min(tau, alpha * exp(-entropy)); default tau 0.09")
    parser.add_argument("--typical-alpha", type=float, default=None, help="--acceptance typical: default alpha 0.3")


def sampling_config(args) -> dict:
    """The `GenerationConfig` keywords of the sampling arguments."""
    return dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                acceptance=args.acceptance, typical_tau=args.typical_tau, typical_alpha=args.typical_alpha)


def check_memory_flags(args) -> None:
    """The offload flags mean nothing without --memory-budget: refuse them rather than ignore them."""
    for flag in ("max_context", "prefetch", "offload_io"):
        if getattr(args, flag, None) is not None:
            raise InvalidArgumentError(f"--{flag.replace('_', '-')} applies with --memory-budget only")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cats", description="CATS: lossless self-speculative decoding")
    commands = parser.add_subparsers(dest="command", required=True)

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

    from cats.bench.cli import add_bench_parser
    from cats.chat import add_chat_parser
    from cats.draft.calibrate import add_calibrate_parser
    from cats.serve.cli import add_serve_parser
    from cats.train.cli import add_train_parser

    add_calibrate_parser(commands)
    add_bench_parser(commands)
    add_train_parser(commands)
    add_serve_parser(commands)
    add_chat_parser(commands)
    return parser


def set_threads(threads: int) -> None:
    if threads < 1:
        raise InvalidArgumentError(f"--threads must be at least 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def quiet_transformers() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


class TextStreamer:
    """Prints decoded text as tokens arrive, holding back an incomplete multi-byte character."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.tokenizer, self.out, self.ids, self.printed = tokenizer, out, [], 0

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
    import cats
    from cats.acceptance import TYPICAL_NEEDS_DRAFTS
    from cats.generate import GenerationConfig, encode_prompt

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
                              **sampling_config(args))
    config.validate()  # fail on bad arguments before the model loads
    method = method_from_args(args)
    if method == "ar" and config.acceptance == "typical":
        raise InvalidArgumentError(TYPICAL_NEEDS_DRAFTS)
    source = args.model or default_model()
    if args.memory_budget is None:
        check_memory_flags(args)
        model = cats.load(source, dtype=args.dtype, pack_weights=args.pack_weights)
        prompt_ids = encode_prompt(model, prompt, chat=args.chat, system=args.system)
    else:
        if args.pack_weights:
            from cats.model.lean import check_packing
            from cats.model.load import resolve_dtype

            check_packing(resolve_dtype(args.dtype), args.memory_budget)
        from cats.generate import encode_with
        from cats.memory.offload import prepare
        from cats.model.load import load_tokenizer

        tokenizer = load_tokenizer(source)
        prompt_ids = encode_with(tokenizer, source, prompt, chat=args.chat, system=args.system)
        context = args.max_context or len(prompt_ids) + args.max_new_tokens
        model = prepare(source, args.memory_budget, dtype=args.dtype, method=method, adapters=args.adapters,
                        draft_layer=args.draft_layer, num_draft_tokens=args.num_draft_tokens,
                        total_tokens=args.total_tokens, context_tokens=context,
                        prefetch=2 if args.prefetch is None else args.prefetch, offload_io=args.offload_io or "direct",
                        tokenizer=tokenizer, prompt_tokens=len(prompt_ids))
        print(model.memory_plan.describe(), file=sys.stderr)
    generator = build_generator(args, model)
    streamer = TextStreamer(model.tokenizer) if model.tokenizer is not None else None
    result = generator.generate(prompt_ids, config, on_tokens=streamer)
    if streamer is not None:
        streamer.finish()
    if args.stats:
        print(result.stats.summary_line(), file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict()))
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
