"""The arguments the ``cats`` commands share (model, method, drafting, sampling, memory), and the settings objects
they make. Ranges are checked by the API, so that the CLI and Python users get the same errors."""

from __future__ import annotations

import argparse

from cats.api import context_window, generator_for
from cats.config import KERNEL_CHOICES, DraftConfig, KernelConfig, MemoryConfig
from cats.errors import InvalidArgumentError
from cats.methods import check_method, help_text
from cats.paths import HUB_DEFAULT, default_model


def integer(text: str) -> int:
    """An integer argument; ranges are checked by the API so that the CLI and Python users get the same errors."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help=f"HF folder, .gguf file or Hub id (default: {HUB_DEFAULT}, "
                        "from ../shared/data when present)")
    parser.add_argument("--dtype", default="float32", help="float weights' dtype: float32 (default), bfloat16, float16 "
                        "or float64 (with a GGUF file, a dtype other than float32 implies --kernels aten)")
    parser.add_argument("--kernels", default="auto", choices=KERNEL_CHOICES,
                        help="auto (default): a GGUF file runs on its own quantised blocks, memory-mapped, on CATS's "
                        "row-invariant AVX-512/AVX2 kernels (8-bit activations, as llama.cpp), other checkpoints on "
                        "float weights; aten: dequantise a GGUF file to float weights of --dtype (the float path, "
                        "for checking)")
    parser.add_argument("--threads", type=integer, default=None, help="torch CPU threads")


def add_pack_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pack-weights", action="store_true",
                        help="bfloat16 or float32: run the layers' and lm_head's linears on packed copies of their "
                        "weights, and attention over few tokens, on CATS's row-invariant AVX-512 kernels (compiled "
                        "on first use; oneDNN-prepacked linears where they cannot run): 2.3-2.7x faster plain "
                        "decoding on CPU, and speculative decoding reproduces plain decoding bit for bit in bf16 too; "
                        "outputs differ from unpacked ones in the last bits; costs about the weights' size of extra "
                        "memory; not with --memory-budget; with a GGUF file it implies --kernels aten")


def add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tree-topk", type=integer, default=None, help="tree/cats/eagle/layer-skip: children per "
                        "expanded node and nodes expanded per depth (1 = a chain; default 4, layer-skip 1, or chosen "
                        "from the budget)")
    parser.add_argument("--total-tokens", type=integer, default=None, help="tree/cats/eagle/recycle/layer-skip trees: "
                        "nodes kept for verification (default 16, or chosen from the budget)")
    parser.add_argument("--depth", type=integer, default=None, help="tree/cats/eagle/recycle/layer-skip trees: maximum "
                        "depth (default 5, recycle and layer-skip 6, or chosen from the budget)")
    parser.add_argument("--sv-threshold", type=float, default=0.05,  # = cats.verify.cascade.SV_THRESHOLD (a test checks)
                        help="cats: the shallow verifier prunes nodes it gives a probability below this (default 0.05)")
    parser.add_argument("--sv-passes", type=integer, default=1,
                        help="cats: shallow passes per deep pass; each extra one redrafts a chain from the shallow "
                        "verifier's own choice at the end of the path it accepts (default 1)")


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--memory-budget", default=None, metavar="BYTES|PERCENT",
                        help="run under a budget of process memory (e.g. 900MiB, 1.5GB, 50%% of the model's bytes in "
                        "the format it runs in, or 50%%+384MiB): the runtime as measured before loading, embeddings, "
                        "lm_head, the draft layers, adapters, KV cache and activations stay resident, the deep layers "
                        "stream: a .gguf on its blocks from the file itself, float weights from a per-layer store in "
                        "$CATS_CACHE/layers (see docs/memory.md)")
    parser.add_argument("--prefetch", type=integer, default=None,
                        help="with --memory-budget: streamed layers read ahead of the one computing (default: 2 where that "
                        "keeps as many layers resident as 1, else 1)")
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
    parser.add_argument("--method", default=default, help=f"{help_text()} (default: {default})")
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
    check_method(args.method)
    if args.no_shallow:
        if args.method != "cats":
            raise InvalidArgumentError("--no-shallow applies to --method cats only")
        return "cats-no-shallow"
    return args.method


def drafting_from_args(args) -> DraftConfig:
    """The `DraftConfig` of the method arguments."""
    return DraftConfig(num_draft_tokens=args.num_draft_tokens, draft_layer=args.draft_layer, max_ngram=args.max_ngram,
                       adapters=args.adapters, threshold=args.threshold, tree_topk=args.tree_topk,
                       total_tokens=args.total_tokens, depth=args.depth, sparsity=args.sparsity,
                       sv_threshold=args.sv_threshold, sv_passes=args.sv_passes)


def load_settings(args) -> tuple[str, str, DraftConfig, KernelConfig]:
    """``(model source, method, drafting, kernels)`` of ``args``, checked: bad settings fail before anything loads."""
    method, drafting = method_from_args(args), drafting_from_args(args)
    drafting.validate()
    kernels = KernelConfig(dtype=args.dtype, pack_weights=args.pack_weights, kernels=args.kernels)
    kernels.validate()
    return args.model or default_model(), method, drafting, kernels


def checked_context_window(source: str, max_context: int | None) -> int:
    """The context window ``source``'s config declares (0 where it declares none); a ``--max-context`` longer than it
    is refused: it would reserve KV cache that no generation could fill."""
    window = context_window(source)
    if window and max_context is not None and max_context > window:
        raise InvalidArgumentError(f"--max-context {max_context} is longer than the model's context window of "
                                   f"{window} tokens; pass at most {window}")
    return window


def build_generator(args, model):
    """A `Generator` for ``model`` with the drafter and scorer that the method arguments ask for."""
    return generator_for(model, method_from_args(args), drafting_from_args(args))


def memory_from_args(args) -> MemoryConfig:
    """The `MemoryConfig` of the memory arguments (``--memory-budget``, ``--prefetch``, ``--offload-io``)."""
    return MemoryConfig(budget=args.memory_budget, offload_io=args.offload_io or "direct",
                        prefetch=args.prefetch, process=True)


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
