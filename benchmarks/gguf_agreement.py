"""How often greedy answers on a GGUF file's own blocks (8-bit activations, `--kernels auto`) match the same file
dequantised to float32 (`--kernels aten`): plain greedy decoding (`ar`) of the first turn of each question on both
paths, exact match and the mean fraction of the float answer reproduced before the first difference.

    python benchmarks/gguf_agreement.py --model ../shared/data/smollm2-135m-instruct-gguf \\
        --questions ../shared/data/mt_bench/question.jsonl --limit 20 --max-new-tokens 64 --out agreement.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

import cats
from cats.config import GenerationConfig
from cats.draft.dytc.hindsight import chain_accepts
from cats.loop.generator import Generator
from cats.prompts import encode_prompt, read_questions


def prefix_fraction(reference: list[int], other: list[int]) -> float:
    """The fraction of ``reference`` that ``other`` reproduces before their first difference."""
    return chain_accepts(other, reference) / max(len(reference), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--questions", required=True)
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the per-question results here (JSON)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    questions = read_questions(args.questions)[: args.limit]
    answers = {}
    for kernels in ("auto", "aten"):
        model = cats.load_model(args.model, kernels=kernels)
        plain, config = Generator(model), GenerationConfig(max_new_tokens=args.max_new_tokens)
        answers[kernels] = [plain.generate(encode_prompt(model, q.turns[0], chat=True), config).token_ids
                            for q in tqdm(questions, desc=f"{model.kernel_path}")]
        model.close()
        del model
    rows = [{"question_id": q.question_id, "category": q.category, "exact": a == b, "prefix": prefix_fraction(b, a)}
            for q, a, b in zip(questions, answers["auto"], answers["aten"])]
    summary = {"model": args.model, "questions": len(rows), "max_new_tokens": args.max_new_tokens,
               "exact_match": sum(r["exact"] for r in rows) / len(rows),
               "prefix_agreement": sum(r["prefix"] for r in rows) / len(rows), "per_question": rows}
    print(f"{len(rows)} questions x {args.max_new_tokens} tokens: exact match {summary['exact_match']:.0%}, "
          f"prefix agreement {summary['prefix_agreement']:.0%}")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
