"""What DyTC reports: a generation's decisions and the current estimates of a `DyTCDrafter` (its ``counters()``,
built here from the scheduler), and the one-line summary of them for ``--stats``."""

from __future__ import annotations

from cats.draft.dytc.hindsight import TREE_SIZES
from cats.draft.dytc.plan import NONE, PLD

REPORTED_TOKENS = (1, 2, 4, 8, 12, 16, 24, 32)


def scheduler_counters(scheduler) -> dict:
    """This generation's decisions (steps, drafted and accepted tokens per drafter, look-ahead use) and the
    current estimates (acceptance, the near-free drafts' yields, latency fits in seconds)."""
    counts = scheduler._counts
    keys = [NONE, PLD] + list(scheduler.options)
    return {
        "choices": {key: counts["choices"][key] for key in keys},
        "drafted": {key: counts["drafted"][key] for key in keys if key != NONE},
        "accepted": {key: counts["accepted"][key] for key in keys if key != NONE},
        "lookahead": {"steps": counts["lookahead_steps"], "tokens": counts["lookahead_tokens"],
                      "accepted": counts["lookahead_accepted"]},
        "hindsight_scored": counts["hindsight"],
        "estimates": {
            # per token: the long-run rates (the last steps' estimate, which the choice reads, swings step to step)
            "acceptance": {key: round(est.long_run(scheduler.step), 4) for key, est in scheduler.acceptance.items()},
            "pld_acceptance": {str(n): round(est.long_run(scheduler.step), 4)
                               for n, est in sorted(scheduler.pld_acceptance.items())},
            "near_free_yield": near_free_report(scheduler),
            "lookahead_yield": round(scheduler.lookahead_yield.ratio(scheduler.step), 4),
            "tree_yield": {key: round(y.ratio(scheduler.step), 4) for key, y in scheduler.tree_yield.items()},
            "verify_latency_s": verify_report(scheduler),
            "draft_latency_s": {key: _rounded(model.coefficients()) for key, model in scheduler.draft_latency.items()},
        },
    }


def verify_report(scheduler) -> dict | None:
    """Predicted seconds of a target forward over n tokens at the latest context, for a few n."""
    if not scheduler.verify_cost.ready:
        return None
    curve = scheduler._verify_curve(max(REPORTED_TOKENS))
    shape = scheduler.verify_cost.shape
    return {"context": scheduler._context, "by_tokens": {str(n): _rounded([curve[n]])[0] for n in REPORTED_TOKENS},
            "measured_shape": shape.to_dict() if shape is not None else None}


def near_free_report(scheduler) -> dict:
    """Per prompt-lookup match class with records: expected accepted tokens per step of prompt lookup's chain
    (at its full length) and of each recycling tree cut alone."""
    report = {}
    chain = scheduler.lookup.num_tokens if scheduler.lookup is not None else 0
    for ngram in sorted(scheduler.hindsight.records):
        expected = scheduler.hindsight.expected(scheduler.step, ngram, chain)
        entry = {"records": scheduler.hindsight.count(scheduler.step, ngram)}
        if ngram and chain:
            entry["pld"] = round(float(expected[0, chain]), 3)
        if scheduler.recycle is not None:
            entry["recycle"] = {str(size): round(float(expected[i, 0]), 3) for i, size in enumerate(TREE_SIZES, 1)}
        report[str(ngram)] = entry
    return report


def _rounded(values: list[float] | None) -> list[float] | None:
    return None if values is None else [float(f"{v:.4g}") for v in values]


def choice_shares(scheduler: dict) -> dict[str, float]:
    """Fraction of decode steps each drafter (or no draft) was chosen."""
    total = sum(scheduler["choices"].values())
    return {key: count / total for key, count in scheduler["choices"].items() if count} if total else {}


def summary_text(scheduler: dict) -> str:
    """One line for ``--stats``: the share of steps per choice and the acceptance estimates."""
    shares = ", ".join(f"{key} {share:.0%}" for key, share in choice_shares(scheduler).items())
    alphas = ", ".join(f"{key} {value:.2f}" for key, value in scheduler["estimates"]["acceptance"].items())
    pld = ", ".join(f"{n}-gram {value:.2f}" for n, value in scheduler["estimates"]["pld_acceptance"].items())
    trees = ", ".join(f"{key} {value:.2f}" for key, value in scheduler["estimates"].get("tree_yield", {}).items())
    parts = [f"chose {shares or 'nothing'}"]
    if alphas:
        parts.append(f"acceptance {alphas}")
    if pld:
        parts.append(f"pld acceptance {pld}")
    if trees:
        parts.append(f"accepted per tree {trees}")
    if scheduler["lookahead"]["steps"]:
        look = scheduler["lookahead"]
        parts.append(f"look-ahead {look['accepted']}/{look['tokens']} tokens accepted")
    return "; ".join(parts)


__all__ = ["REPORTED_TOKENS", "choice_shares", "near_free_report", "scheduler_counters", "summary_text",
           "verify_report"]
