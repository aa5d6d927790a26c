"""Tokens/s by method and model from ``cats bench`` summaries (one per model), as grouped bars: the figure in
docs/benchmarks.md.

    python benchmarks/gguf_plot.py --out docs/results/gguf-tokens-per-s.png \\
        SmolLM2-135M=docs/results/gguf-smollm2/summary.json Qwen2.5-Coder-1.5B=docs/results/gguf-qwen-mtbench/summary.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=SUMMARY", help="a model's label and its summary.json")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    runs = []
    for item in args.runs:
        label, _, path = item.partition("=")
        runs.append((label, json.loads(Path(path).read_text())["methods"]))
    methods = list(dict.fromkeys(name for _, table in runs for name in table))
    width = 0.8 / len(runs)
    figure, axis = plt.subplots(figsize=(max(6, 1.1 * len(methods)), 3.6))
    for index, (label, table) in enumerate(runs):
        positions = [m + (index - (len(runs) - 1) / 2) * width for m in range(len(methods))]
        values = [table.get(name, {}).get("tokens_per_s") or 0.0 for name in methods]
        bars = axis.bar(positions, values, width, label=label)
        axis.bar_label(bars, labels=[f"{v:.1f}" if v else "" for v in values], fontsize=7)
    axis.set_xticks(range(len(methods)), methods, rotation=20)
    axis.set_ylabel("tokens/s (2 threads, greedy)")
    axis.set_yscale("log")
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=2, frameon=False)
    figure.tight_layout()
    figure.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
