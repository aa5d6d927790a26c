"""One Markdown table over several `cats bench` runs (e.g. exact vs typical acceptance, greedy vs sampled):
per run and method the acceptance label, temperature, speedup, mean accepted tokens, drift from greedy (prefix
agreement and exact match with ar, greedy runs only) and two quality proxies of the answers:

* log-lik/token: the target's mean log-probability (temperature 1) of each answer token given the prompt and the
  answer before it; typical acceptance keeps only tokens the target finds likely, so it tends to raise this
  relative to exact sampling at the same temperature;
* distinct-2: distinct bigrams / bigrams of each answer, averaged (low values flag repetitive answers).

Usage: python benchmarks/typical_report.py RUN_DIR [RUN_DIR ...] > table.md
The model, dtype, question file and prompt format are read from each run's summary.json (first turns only).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

import cats
from cats.bench.answers import read_answers
from cats.bench.prompts import Conversation
from cats.prompts import read_questions


@torch.inference_mode()
def answer_loglik(model, prompt_ids: list[int], answer_ids: list[int]) -> float | None:
    """Mean log p(answer token | prompt, earlier answer tokens) under the target, temperature 1."""
    if not answer_ids:
        return None
    ids = torch.tensor([prompt_ids + answer_ids], device=model.device)
    logits = model.hf_model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return float(torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt_ids):, None]).mean())


def distinct_bigrams(tokens: list[int]) -> float | None:
    bigrams = list(zip(tokens, tokens[1:]))
    return len(set(bigrams)) / len(bigrams) if bigrams else None


def quality(model, run: Path, summary: dict, method: str) -> tuple[float | None, float | None]:
    questions = {q.question_id: q for q in read_questions(summary["question_file"])}
    logliks, distinct = [], []
    for answer in read_answers(run / f"{method}.jsonl"):
        if answer.get("error"):
            continue
        question = questions[answer["question_id"]]
        tokens = answer["choices"][0]["token_ids"][0]
        prompt_ids = Conversation(model.tokenizer, summary.get("prompt_format", "chat")).prompt_ids(question.turns[0])
        for values, value in ((logliks, answer_loglik(model, prompt_ids, tokens)), (distinct, distinct_bigrams(tokens))):
            if value is not None:
                values.append(value)
    return (float(np.mean(logliks)) if logliks else None, float(np.mean(distinct)) if distinct else None)


def cell(value, digits=2, suffix=""):
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="cats bench output folders (with summary.json)")
    args = parser.parse_args()
    models: dict[tuple[str, str], cats.LayeredModel] = {}
    print("| run | method | acceptance | temperature | speedup | mean accepted | prefix agreement with ar "
          "| exact match | log-lik/token | distinct-2 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for run in args.runs:
        summary = json.loads((run / "summary.json").read_text())
        key = (summary["model"], summary["dtype"])
        if key not in models:
            models[key] = cats.load_model(summary["model"], dtype=summary["dtype"])
        for method, m in summary["methods"].items():
            if not (run / f"{method}.jsonl").is_file() or method.startswith(("hf-", "llama-cpp")):
                continue
            loglik, distinct = quality(models[key], run, summary, method)
            print(f"| {run.name} | {method} | {m.get('acceptance', 'exact')} | {summary.get('temperature', 0):g} "
                  f"| {cell(m['speedup'], 2, 'x')} | {cell(m['mean_accepted'])} "
                  f"| {cell(m.get('prefix_agreement'), 3)} | {cell(m['exact_match'], 3)} | {cell(loglik, 3)} "
                  f"| {cell(distinct, 3)} |")


if __name__ == "__main__":
    main()
