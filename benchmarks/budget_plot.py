"""Combine `cats bench --memory-budget` runs (one folder per budget) into one table and a plot of tokens/s against
the budget per method: ``python benchmarks/budget_plot.py --out DIR RUN_DIR...`` (see memory_budget.sh).

Every figure comes from the runs' summary.json files; a method skipped under a budget (below its minimum) is shown
as such, not as zero."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(run: Path) -> dict | None:
    summary = run / "summary.json"
    return json.loads(summary.read_text()) if summary.is_file() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    series = {}
    print("| budget | budget MiB | method | tokens/s | vs ar | mean accepted | streamed layers | read MiB | "
          "hidden I/O | peak RSS MiB | within budget | exact match |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for run in args.runs:
        summary = load(run)
        if summary is None:
            print(f"| {run.name} | – | (no summary: the run failed) | | | | | | | | | |")
            continue
        budget = summary["memory_budget"]
        ar = summary["methods"].get("ar", {}).get("tokens_per_s")
        for name, m in summary["methods"].items():
            offload = m.get("offload") or {}
            layers = (m.get("memory") or {}).get("plan", {}) or {}
            streamed = layers.get("streamed_layers")
            tokens_per_s = m.get("tokens_per_s")
            ratio = f"{tokens_per_s / ar:.2f}x" if tokens_per_s and ar else "–"
            accepted = f"{m['mean_accepted']:.2f}" if m.get("mean_accepted") is not None else "–"
            hidden = f"{offload['hidden_fraction']:.0%}" if offload.get("hidden_fraction") is not None else "–"
            read = f"{offload['bytes_read'] / 2**20:.0f}" if offload.get("bytes_read") is not None else "–"
            match = f"{m['exact_match']:.2f}" if m.get("exact_match") is not None else "–"
            print(f"| {budget} | {summary['memory_budget_mb']} | {name} | {tokens_per_s or 0:.2f} | {ratio} | "
                  f"{accepted} | {streamed if streamed else '–'} | {read} | {hidden} | {m.get('peak_rss_mb')} | "
                  f"{m.get('within_budget')} | {match} |")
            series.setdefault(name, []).append((float(budget.split("+")[0].rstrip("%")), tokens_per_s))
        for name, reason in summary.get("skipped", {}).items():
            print(f"| {budget} | {summary['memory_budget_mb']} | {name} | skipped: {reason} | | | | | | | | |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for name, points in sorted(series.items()):
        points.sort()
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    axes.set_xlabel("memory budget (% of the weight bytes)")
    axes.set_ylabel("tokens/s")
    axes.set_yscale("log")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out / "tokens_per_s_vs_budget.png", dpi=120)
    print(f"\nplot: {args.out / 'tokens_per_s_vs_budget.png'}")


if __name__ == "__main__":
    main()
