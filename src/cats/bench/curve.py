"""``cats bench --memory-limit 25%,50%,75%,100%,150%``: the whole benchmark once per limit (each in its own folder,
``OUT/limit-<label>``), then tokens/s against the limit for every method: ``OUT/curve.json``, ``OUT/curve.md`` and
one plot, ``OUT/memory_curve.png``. Where a method stops being faster shows as its line falling off; a method that
cannot run under a limit (refused, or killed by the OOM killer) has no point there and the table says why."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path

from cats.bench.plots import plot_memory_curve
from cats.bench.runner import BenchConfig, NothingRanError, run_bench, write_atomically

CURVE_PLOT, CURVE_JSON, CURVE_REPORT = "memory_curve.png", "curve.json", "curve.md"


def limit_folder(limit: str) -> str:
    """``"50%+384MiB"`` -> ``"limit-50pct+384MiB"``: a folder name for one limit's run."""
    return "limit-" + re.sub(r"[^A-Za-z0-9.+-]", "", limit.replace("%", "pct"))


def run_curve(config: BenchConfig, limits: list[str]) -> dict:
    """One run per limit, then the curve (see the module docstring)."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in (CURVE_PLOT, CURVE_JSON, CURVE_REPORT):
        (out / name).unlink(missing_ok=True)
    points = []
    summary = None
    for limit in limits:
        try:
            summary = run_bench(replace(config, memory_limit=limit, out=out / limit_folder(limit)))
        except NothingRanError as nothing:  # a point where no method runs: said, and the curve goes on
            points.append({"limit": limit, "limit_mb": nothing.limit_mb, "folder": limit_folder(limit), "methods": {},
                           "peak_memory_mb": {}, "exact_match": {}, "skipped": nothing.skipped})
            continue
        points.append({
            "limit": limit, "limit_mb": summary["memory_limit_mb"], "folder": limit_folder(limit),
            "methods": {name: m["tokens_per_s"] for name, m in summary["methods"].items()},
            "peak_memory_mb": {name: m.get("peak_memory_mb") for name, m in summary["methods"].items()},
            "exact_match": {name: m["exact_match"] for name, m in summary["methods"].items()},
            "skipped": summary["skipped"],
        })
    curve = {"model": config.model, "threads": summary["threads"] if summary else config.threads,
             "questions": summary["questions"] if summary else None, "max_new_tokens": config.max_new_tokens,
             "points": points}
    temporary = out / f".{CURVE_PLOT}.tmp.png"
    if plot_memory_curve(curve, temporary):
        os.replace(temporary, out / CURVE_PLOT)
    write_atomically(out / CURVE_REPORT, render_curve(curve, config.methods))
    write_atomically(out / CURVE_JSON, json.dumps(curve, indent=2) + "\n")
    return curve


def render_curve(curve: dict, methods: list[str]) -> str:
    lines = ["# tokens/s against the memory limit", "",
             f"`{curve['model']}`, {curve['threads']} threads, {curve['questions']} questions x "
             f"{curve['max_new_tokens']} new tokens; each limit's full report is in its folder.", "",
             "| limit | MiB | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for point in curve["points"]:
        cells = []
        for name in methods:
            speed = point["methods"].get(name)
            cells.append(f"{speed:.2f}" if speed is not None else "–")
        link = f"[{point['limit']}]({point['folder']}/report.md)" if point["methods"] else point["limit"]
        lines.append(f"| {link} | {point['limit_mb']:.0f} | "
                     + " | ".join(cells) + " |")
    notes = [f"- {point['limit']}: `{name}` did not run: {why}" for point in curve["points"]
             for name, why in point["skipped"].items()]
    if notes:
        lines += ["", "## Methods that did not run", ""] + notes
    return "\n".join(lines) + "\n"
