"""Choose CATS defaults by measurement: run ``ar`` and a grid of method settings on the same questions in one
process, interleaved per question (so machine noise hits every setting alike), and print tokens/s, the ratio to
``ar`` measured in the same run, the mean tokens per target forward and the shallow verifier's counters.

Example (the sweep behind the defaults in docs/benchmarks.md):

    python benchmarks/sweep.py --adapters adapters/smollm2-135m-instruct --dtype bfloat16 --questions 12 \
        --max-new-tokens 128 --grid early-exit:num_draft_tokens=4,threshold=0.3 \
        --grid cats:tree_topk=4,total_tokens=16,depth=5 --out sweep.json

Each ``--grid METHOD:key=value,...`` is one setting; keys are `cats.api.generate` keywords
(num_draft_tokens, threshold, tree_topk, total_tokens, depth, sv_threshold, sv_passes), or ``adapters=DIR`` (this
setting's adapters folder instead of ``--adapters``). A key with several values separated by ``|`` expands into one
setting per value (``depth=4|6``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import cats
from cats.api import generator_for
from cats.config import DraftConfig, GenerationConfig
from cats.loop.generator import Generator
from cats.methods import METHODS
from cats.prompts import encode_prompt

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
INTEGER_KEYS = {"num_draft_tokens", "tree_topk", "total_tokens", "depth", "sv_passes"}


def parse_grid(text: str) -> list[tuple[str, dict]]:
    method, _, rest = text.partition(":")
    keys, choices = [], []
    for item in filter(None, rest.split(",")):
        key, _, values = item.partition("=")
        keys.append(key)
        choices.append([v if key == "adapters" else int(v) if key in INTEGER_KEYS else float(v)
                        for v in values.split("|")])
    return [(method, dict(zip(keys, combo))) for combo in itertools.product(*choices)] if keys else [(method, {})]


def label(method: str, settings: dict) -> str:
    return method + ("(" + ",".join(f"{k}={v}" for k, v in settings.items()) + ")" if settings else "")


def build(model, method: str, settings: dict, adapters: str | None) -> Generator:
    settings = dict(settings)
    adapters = settings.pop("adapters", adapters)  # a setting may name its own adapters folder
    drafting = DraftConfig(adapters=adapters if "adapters" in METHODS[method].settings else None, **settings)
    return generator_for(model, method, drafting)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DATA / "smollm2-135m-instruct-gguf"))
    parser.add_argument("--questions-file", default=str(DATA / "mt_bench" / "question.jsonl"))
    parser.add_argument("--questions", type=int, default=12, help="first turns of this many questions, spread over "
                        "the file's categories")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--adapters", default=None)
    parser.add_argument("--grid", action="append", default=[], help="METHOD:key=v1|v2,key=v (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--pack-weights", action="store_true", help="prepacked linears and the AVX-512 kernels, as "
                        "`cats bench --pack-weights`")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = cats.load_model(args.model, dtype=args.dtype, pack_weights=args.pack_weights)
    rows = [json.loads(line) for line in Path(args.questions_file).read_text().splitlines() if line.strip()]
    by_category: dict[str, list] = {}
    for row in rows:
        by_category.setdefault(row.get("category", ""), []).append(row)
    picked = [row for group in itertools.zip_longest(*by_category.values()) for row in group if row][: args.questions]
    prompts = [encode_prompt(model, row["turns"][0], chat=True) for row in picked]
    settings = [("ar", {})] + [item for text in args.grid for item in parse_grid(text)]
    generators = {label(m, s): build(model, m, s, args.adapters) for m, s in settings}
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    for generator in generators.values():  # warm-up
        generator.generate(prompts[0], GenerationConfig(max_new_tokens=16))
    results = {name: {"tokens": 0, "seconds": 0.0, "forwards": 0, "per_question": [], "shallow": []} for name in generators}
    for index, prompt in enumerate(prompts):
        for name, generator in generators.items():
            start = time.perf_counter()
            result = generator.generate(prompt, config)
            seconds = time.perf_counter() - start
            entry = results[name]
            entry["tokens"] += len(result.token_ids)
            entry["seconds"] += seconds
            entry["forwards"] += result.stats.target_forwards
            entry["per_question"].append(len(result.token_ids) / seconds)
            if result.stats.shallow:
                entry["shallow"].append(result.stats.shallow)
        print(f"question {index + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    base = results["ar"]["tokens"] / results["ar"]["seconds"]
    print(f"{'setting':<70} {'tok/s':>7} {'vs ar':>6} {'tok/fwd':>8}")
    summary = {}
    for name, entry in results.items():
        rate = entry["tokens"] / entry["seconds"]
        per_forward = entry["tokens"] / max(1, entry["forwards"])  # the prefill forward included
        shallow = None
        if entry["shallow"]:
            keys = ("true_positive", "false_positive", "true_negative", "false_negative", "nodes_drafted",
                    "nodes_pruned", "nodes_verified", "nodes_corrected", "steps", "redraft_passes")
            shallow = {key: sum(s.get(key, 0) for s in entry["shallow"]) for key in keys}
        summary[name] = {"tokens_per_s": round(rate, 2), "vs_ar": round(rate / base, 3),
                         "tokens_per_forward": round(per_forward, 3),
                         "median_question_vs_ar": round(statistics.median(
                             a / b for a, b in zip(entry["per_question"], results["ar"]["per_question"])), 3),
                         "shallow": shallow}
        print(f"{name:<70} {rate:7.1f} {rate / base:6.2f} {per_forward:8.2f}")
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "questions": len(prompts),
                                        "dtype": args.dtype, "pack_weights": args.pack_weights,
                                        "max_new_tokens": args.max_new_tokens,
                                        "results": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
