"""``cats train data`` (self-distillation data), ``cats train features`` (final features for feature adapters) and
``cats train adapter`` (adapter training): the arguments, and the calls into `cats.train`."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from cats.cli.args import add_model_arguments, integer
from cats.errors import InvalidArgumentError
from cats.model import load_model
from cats.model.adapter import BLOCKS, INITS, INPUTS, ROLES
from cats.paths import default_model
from cats.train.data import ANSWERS, DataConfig, make_features, make_training_data
from cats.train.folder import DataMix, TrainingData
from cats.train.trainer import ARCHS, MIXED_PRECISIONS, SAVE_DTYPES, TrainConfig, train_adapter


def add_train_parser(commands) -> None:
    train = commands.add_parser("train", help="make training data and train draft / shallow adapters")
    steps = train.add_subparsers(dest="train_command", required=True)
    add_data_parser(steps)
    add_features_parser(steps)
    add_adapter_parser(steps)


# ====================================================================== command line
def parse_layers(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InvalidArgumentError(f"--layers expects comma-separated layer numbers such as 3,15; "
                                   f"got {text!r}") from None


def add_data_parser(subparsers) -> None:
    data = subparsers.add_parser(
        "data", help="self-distillation data: the target answers prompts, hidden states and top-k are stored",
        description="The target answers every prompt itself (batched generation, chat template applied); per sample "
                    "the token ids, a loss mask over the response, hidden states after --layers and the target's top-k "
                    "next-token probabilities are written to safetensors shards in --out. A rerun with the same "
                    "arguments continues after the last complete shard; a larger --limit extends the data.",
    )
    add_model_arguments(data)
    data.add_argument("--prompts", type=Path, required=True,
                      help="ShareGPT JSON (first human turn) or Spec-Bench / MT-Bench .jsonl (first turn)")
    data.add_argument("--out", type=Path, required=True, help="data folder (created; reused to resume)")
    data.add_argument("--layers", required=True, help="store hidden states after these layers, e.g. 3,15 "
                      "(each in 1 .. num_layers-1)")
    data.add_argument("--max-new-tokens", type=integer, default=256, help="answer length limit (default 256)")
    data.add_argument("--max-prompt-tokens", type=integer, default=256,
                      help="longer prompts keep the end of their user text (default 256, chat template included)")
    data.add_argument("--samples-per-prompt", type=integer, default=1, help="answers per prompt (needs "
                      "--temperature > 0 above 1)")
    data.add_argument("--temperature", type=float, default=0.0,
                      help="0: greedy (default); above 0: sampling, seeded per prompt and sample")
    data.add_argument("--top-k", type=integer, default=20,
                      help="teacher probabilities stored per position (default 20)")
    data.add_argument("--limit", type=integer, default=None, help="only the first N prompts of the file")
    data.add_argument("--batch-size", type=integer, default=8, help="answers generated together (default 8)")
    data.add_argument("--shard-prompts", type=integer, default=64, help="prompts per shard (default 64)")
    data.add_argument("--seed", type=integer, default=0, help="sampling seed (default 0)")
    data.add_argument("--answers", choices=ANSWERS, default="generate",
                      help="generate (default): the target answers each prompt (self-distillation); given: "
                      "teacher-force the assistant turn a ShareGPT file holds after each prompt (one prefill per "
                      "sample, much faster on a CPU)")
    data.add_argument("--features", action="store_true",
                      help="also store the final features of every position from the same forward (what feature "
                      "adapters train on; saves a `cats train features` pass)")
    data.add_argument("--no-progress", action="store_true", help="no progress bar (per-shard lines still print)")
    data.set_defaults(run=run_data_command)


def add_features_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "features", help="add the target's final features to a data folder (for feature draft adapters)",
        description="Teacher-forces every sample of a `cats train data` folder through the whole target and writes "
                    "its final normed states (what the lm_head reads) beside each shard; resumes at the first shard "
                    "without them. Load the model in the data's dtype.")
    add_model_arguments(parser)
    parser.add_argument("--data", type=Path, required=True, help="data folder (cats train data)")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(run=run_features_command)


def run_features_command(args: argparse.Namespace) -> int:
    model = load_model(args.model or default_model(), dtype=args.dtype, kernels=args.kernels)
    written = make_features(model, args.data, progress=not args.no_progress)
    print(f"{args.data}: final features written for {written} shard(s)")
    return 0


def run_data_command(args: argparse.Namespace) -> int:
    config = DataConfig(
        prompts=args.prompts, out=args.out, layers=parse_layers(args.layers), max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens, samples_per_prompt=args.samples_per_prompt,
        temperature=args.temperature, top_k=args.top_k, limit=args.limit, batch_size=args.batch_size,
        shard_prompts=args.shard_prompts, seed=args.seed, progress=not args.no_progress, answers=args.answers,
        features=args.features,
    )
    model = load_model(args.model or default_model(), dtype=args.dtype, kernels=args.kernels)
    make_training_data(model, config)
    return 0


# ---------------------------------------------------------------------------------------------------------- CLI
def add_adapter_parser(subparsers) -> None:
    parser = subparsers.add_parser("adapter", help="train a draft or shallow adapter, or an EAGLE-3 head, on "
                                   "`cats train data` output")
    add_model_arguments(parser)
    parser.add_argument("--data", type=Path, required=True, action="append",
                        help="training data folder (cats train data); repeat it to train on several as one")
    parser.add_argument("--eval-data", type=Path, default=None, help="held-out data folder (e.g. MT-Bench answers)")
    parser.add_argument("--arch", choices=ARCHS, default="adapter",
                        help="adapter (default): a CATS adapter (--role, --layer, --input); eagle3: an EAGLE-3 draft "
                        "head, the layout vLLM, SGLang and llama.cpp load (`cats export`)")
    parser.add_argument("--role", choices=ROLES, default=None, help="adapters: draft or shallow (required)")
    parser.add_argument("--layer", type=integer, default=None,
                        help="adapters: the adapter reads the state after this layer (required)")
    parser.add_argument("--aux-layers", default=None,
                        help="eagle3: the three target layers it reads, e.g. 2,14,25 (default 2, n/2, n-3)")
    parser.add_argument("--heads", type=integer, default=None, help="eagle3: attention heads (default the target's)")
    parser.add_argument("--kv-heads", type=integer, default=None,
                        help="eagle3: key/value heads (default the target's, at most --heads)")
    parser.add_argument("--intermediate-size", type=integer, default=None,
                        help="eagle3: MLP width (default the target's)")
    parser.add_argument("--ttt-weight", type=float, default=None,
                        help="eagle3: weight of the training-time test's second step, fed its own output (default "
                        "0.8; 0: off)")
    parser.add_argument("--out", type=Path, required=True, help="adapter folder to write")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--batch-tokens", type=integer, default=512)
    parser.add_argument("--warmup-steps", type=integer, default=15)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--position-fraction", type=float, default=0.35,
                        help="fraction of response positions that carry the loss in each batch")
    parser.add_argument("--init", choices=INITS, default=None,
                        help="next: the target's layer L (0-based, the one the adapter replaces); copy: its last layer")
    parser.add_argument("--block", choices=BLOCKS, default=None,
                        help="decoder (attention + MLP, default) or attention only")
    parser.add_argument("--input", choices=INPUTS, default=None,
                        help="hidden: the state after --layer; features: EAGLE-style feature draft adapter reading the "
                             "final features and the next token (--role draft --layer <num layers>; needs "
                             "`cats train features`); features+hidden: the final features and the next token's state "
                             "after --layer (an early-exit draft adapter that also reads the target's features)")
    parser.add_argument("--feature-loss", type=float, default=None,
                        help="feature adapters: weight of the smooth-L1 regression to the next feature (default 1)")
    parser.add_argument("--draft-vocab", type=integer, default=None,
                        help="reduced vocabulary: the N most frequent response tokens of the data (e.g. 8192)")
    parser.add_argument("--eval-every", type=integer, default=0, help="held-out evaluation every N steps (and each epoch)")
    parser.add_argument("--save-dtype", choices=SAVE_DTYPES, default="float32",
                        help="dtype of the stored adapter weights (bfloat16: half the bytes; default float32)")
    parser.add_argument("--mixed-precision", choices=MIXED_PRECISIONS, default="no",
                        help="bf16: matrix products under bfloat16 autocast (several times faster on CPUs with AMX or "
                        "AVX-512 BF16); weights, gradients and optimizer state stay float32 (default no)")
    parser.add_argument("--checkpoint-every", type=integer, default=200)
    parser.add_argument("--max-steps", type=integer, default=None)
    parser.add_argument("--seed", type=integer, default=0)
    parser.add_argument("--tensorboard", action="store_true", help="log to OUT/cats-adapter (needs tensorboard)")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(run=run_adapter_command)


def run_adapter_command(args: argparse.Namespace) -> int:
    if args.tensorboard:
        if importlib.util.find_spec("tensorboard") is None:
            raise InvalidArgumentError("--tensorboard needs the tensorboard package: pip install tensorboard")
    adapter_only = ("role", "layer", "init", "block", "input", "feature_loss")
    eagle3_only = ("aux_layers", "heads", "kv_heads", "intermediate_size", "ttt_weight")
    for name in adapter_only if args.arch == "eagle3" else eagle3_only:
        if getattr(args, name) is not None:
            other = "an adapter (--arch adapter)" if args.arch == "eagle3" else "--arch eagle3"
            raise InvalidArgumentError(f"--{name.replace('_', '-')} is a setting of {other}")
    if args.arch == "adapter" and (args.role is None or args.layer is None):
        raise InvalidArgumentError("an adapter needs --role and --layer (or train an EAGLE-3 head: --arch eagle3)")
    model = load_model(args.model or default_model(), dtype="float32")
    data = DataMix.open(args.data, model=model)
    eval_data = TrainingData.open(args.eval_data, model=model) if args.eval_data else None
    if args.arch == "eagle3":
        shape = dict(role="draft", layer=model.num_layers, arch="eagle3", heads=args.heads, kv_heads=args.kv_heads,
                     intermediate_size=args.intermediate_size, ttt_weight=args.ttt_weight,
                     aux_layers=parse_layers(args.aux_layers) if args.aux_layers else None)
    else:
        shape = dict(role=args.role, layer=args.layer, init=args.init or "next", block=args.block or "decoder",
                     input=args.input or "hidden", feature_loss=1.0 if args.feature_loss is None else args.feature_loss)
    config = TrainConfig(
        **shape, out=args.out, epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens,
        warmup_steps=args.warmup_steps, grad_clip=args.grad_clip, position_fraction=args.position_fraction,
        draft_vocab=args.draft_vocab, eval_every=args.eval_every, save_dtype=args.save_dtype,
        mixed_precision=args.mixed_precision,
        checkpoint_every=args.checkpoint_every, max_steps=args.max_steps, seed=args.seed,
        tensorboard=args.tensorboard, progress=not args.no_progress, command="cats " + " ".join(sys.argv[1:]),
    )
    out = train_adapter(model, data, config, eval_data)
    print(f"wrote {'EAGLE-3 head' if args.arch == 'eagle3' else 'adapter'} {out}")
    return 0
