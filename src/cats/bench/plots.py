"""PNG plots of a summary and its answers, drawn with matplotlib's Agg canvas (no display, no pyplot state)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

SPEEDUP_PLOT = "speedup_per_category.png"
ACCEPT_PLOT = "accept_length_histogram.png"


def _figure(width: float, height: float):
    """A figure on an Agg canvas; matplotlib is imported only here (a budgeted run's worker processes, whose memory
    is measured, never draw)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    return figure


def plot_speedup(summary: dict, path: Path) -> bool:
    """Grouped bars: speedup over the baseline per category (and overall), one bar per method. False when there is
    no baseline to compare with (nothing drawn)."""
    methods = {name: m for name, m in summary["methods"].items() if m["speedup"] is not None}
    if not methods:
        return False
    categories = list(dict.fromkeys(cat for m in methods.values() for cat in m["per_category"])) + ["overall"]
    figure = _figure(max(6.0, 1.0 + 0.9 * len(categories)), 4.0)
    axes = figure.add_subplot()
    width = 0.8 / len(methods)
    x = np.arange(len(categories))
    for i, (name, m) in enumerate(methods.items()):
        values = [(m["per_category"].get(cat) or {}).get("speedup") for cat in categories[:-1]] + [m["speedup"]]
        axes.bar(x + (i - (len(methods) - 1) / 2) * width, [v if v is not None else 0 for v in values], width,
                 label=name)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks(x, categories, rotation=30, ha="right")
    axes.set_ylabel(f"speedup over {summary['baseline']}")
    axes.set_title(f"{Path(str(summary['model'])).name}, {summary['dtype']}, {summary['threads']} threads")
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, not on them
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def plot_accept_lengths(answers: dict[str, list[dict]], path: Path) -> bool:
    """Histogram of tokens committed per target forward, one bar group per method (fraction of its steps)."""
    counts = {}
    for name, method_answers in answers.items():
        lengths = [n for a in method_answers if not a.get("error") for n in a["choices"][0]["accept_lengths"]]
        if lengths:
            counts[name] = Counter(lengths)
    if not counts:
        return False
    longest = max(max(c) for c in counts.values())
    x = np.arange(1, longest + 1)
    figure = _figure(max(6.0, 0.4 * longest + 2), 4.0)
    axes = figure.add_subplot()
    width = 0.8 / len(counts)
    for i, (name, counter) in enumerate(counts.items()):
        total = sum(counter.values())
        axes.bar(x + (i - (len(counts) - 1) / 2) * width, [counter.get(n, 0) / total for n in x], width, label=name)
    axes.set_xticks(x)
    axes.set_xlabel("tokens committed per target forward")
    axes.set_ylabel("fraction of decode steps")
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, not on them
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def plot_memory_curve(curve: dict, path: Path) -> bool:
    """Tokens/s against the memory limit, one line per method (a method that could not run under a limit has no
    point there). ``curve``: `cats.bench.curve` 's ``{"points": [{"limit_mb", "methods": {name: tokens/s}}]}``."""
    names = list(dict.fromkeys(name for point in curve["points"] for name in point["methods"]))
    if not names:
        return False
    figure = _figure(7.0, 4.5)
    axes = figure.add_subplot()
    for name in names:
        xy = [(p["limit_mb"], p["methods"][name]) for p in curve["points"] if p["methods"].get(name) is not None]
        if xy:
            axes.plot(*zip(*xy), marker="o", label=name)
    for point in curve["points"]:
        axes.axvline(point["limit_mb"], color="0.85", linewidth=0.6, zorder=0)
    axes.set_xlabel("memory limit, MiB (a cgroup: anonymous memory + page cache)")
    axes.set_ylabel("tokens/s")
    axes.set_yscale("log")
    axes.set_title(f"{Path(str(curve['model'])).name}, {curve['threads']} threads")
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True
