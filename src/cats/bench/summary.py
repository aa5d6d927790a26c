"""From answers to numbers: tokens/s, Spec-Bench speedup, mean accepted tokens, exact match and prefix agreement.

Everything here works on answer records (`cats.bench.answers`), so a test can check it on a hand-written case.
A question whose answer has an ``error`` counts as a failure and is left out of the speed figures.

Token comparisons (exact match, prefix agreement with ``ar``) are made for greedy runs only (temperature 0): sampled
outputs differ from run to run by design. At temperature 0 they measure how far typical acceptance (lossy) drifts
from greedy decoding; exact acceptance must give 1.0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from cats.verify.cascade import ShallowCounts

BASELINE_CANDIDATES = ("ar", "hf-ar")  # speedups are relative to the faster of these that ran
REFERENCE_CANDIDATES = ("ar", "hf-ar")  # exact_match compares tokens with the first of these that ran


def choice(answer: dict) -> dict:
    return answer["choices"][0]


def ok(answers: Iterable[dict]) -> list[dict]:
    return [a for a in answers if not a.get("error")]


def question_speed(answer: dict) -> float:
    """Tokens per second of one question, all turns together: ``sum(new_tokens) / sum(wall_time)``."""
    time_s = sum(choice(answer)["wall_time"])
    return sum(choice(answer)["new_tokens"]) / time_s if time_s > 0 else 0.0


def mean_speed(answers: Sequence[dict]) -> float | None:
    """Spec-Bench's "tokens per second": the mean over questions of each question's tokens/s."""
    return float(np.mean([question_speed(a) for a in answers])) if answers else None


def aggregate_speed(answers: Sequence[dict]) -> float | None:
    """Total new tokens / total wall time."""
    time_s = sum(sum(choice(a)["wall_time"]) for a in answers)
    return sum(sum(choice(a)["new_tokens"]) for a in answers) / time_s if answers and time_s > 0 else None


def speedup(method_answers: Sequence[dict], baseline_answers: Sequence[dict]) -> tuple[float | None, float | None]:
    """``(speedup, aggregate speedup)`` of a method over the baseline, on the questions both answered.

    ``speedup`` is computed as Spec-Bench's ``evaluation/speed.py`` does::

        speedup = mean_q(tokens_q / time_q  of the method) / mean_q(tokens_q / time_q  of the baseline)

    where ``tokens_q = sum(new_tokens)`` and ``time_q = sum(wall_time)`` over the question's turns: the ratio of the
    two mean per-question speeds (not the mean of per-question ratios). Two deliberate differences from speed.py:
    the baseline's tokens are its recorded ``new_tokens`` (speed.py re-tokenizes the baseline's text and subtracts
    one for BOS, an approximation of the same count), and failed questions of either side are left out of both.

    ``aggregate speedup`` = (total tokens / total time of the method) / (the same for the baseline).
    """
    base_ids = {a["question_id"] for a in ok(baseline_answers)}
    method_ids = {a["question_id"] for a in ok(method_answers)}
    common = base_ids & method_ids
    mine = [a for a in method_answers if a["question_id"] in common]
    base = [a for a in baseline_answers if a["question_id"] in common]
    if not common:
        return None, None
    ratio = _ratio(mean_speed(mine), mean_speed(base))
    aggregate = _ratio(aggregate_speed(mine), aggregate_speed(base))
    return ratio, aggregate


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def mean_accepted(answers: Sequence[dict]) -> float | None:
    """Mean tokens committed per target forward after the first, pooled over all steps of all questions
    (``np.mean`` of the concatenated ``accept_lengths``, as speed.py); None when no question took a decode step."""
    lengths = [n for a in answers for n in choice(a)["accept_lengths"]]
    return float(np.mean(lengths)) if lengths else None


def tokens_per_forward(answers: Sequence[dict]) -> float | None:
    """New tokens per target forward after each turn's first (the prompt's), pooled: what every method reports,
    llama-server's included (its forwards counted from its accepted drafts)."""
    counted = [a for a in answers if choice(a).get("decoding_steps")]
    tokens = sum(n - 1 for a in counted for n in choice(a)["new_tokens"] if n > 0)
    steps = sum(max(0, n - 1) for a in counted for n in choice(a)["decoding_steps"])
    return tokens / steps if steps else None


def draft_acceptance(answers: Sequence[dict]) -> float | None:
    """Accepted over drafted tokens, pooled over every turn of methods that record their drafts; None otherwise."""
    drafts = [pair for a in answers for pair in choice(a).get("drafts", [])]
    drafted = sum(pair[0] for pair in drafts)
    return sum(pair[1] for pair in drafts) / drafted if drafted else None


def answer_tokens(answer: dict) -> list:
    """What equality compares: the token ids of every turn, or the text turns for files without token ids."""
    c = choice(answer)
    return c["token_ids"] if "token_ids" in c else c["turns"]


def shallow_totals(answers: Sequence[dict]) -> dict | None:
    """The cascade's shallow-verifier counters summed over every turn (precision, recall, F1 and keep rate
    recomputed from the sums); None when the method has no cascade."""

    turns = [counts for a in answers for counts in choice(a).get("shallow", [])]
    if not turns:
        return None
    total = ShallowCounts()
    for counts in turns:
        for key in total.__dataclass_fields__:
            setattr(total, key, getattr(total, key) + counts[key])
    return total.to_dict()


def scheduler_totals(answers: Sequence[dict]) -> dict | None:
    """The DyTC scheduler's decisions summed over every turn (steps, drafted and accepted tokens per drafter,
    look-ahead use), each drafter's acceptance rate from the sums, and the estimates after the last turn; None
    when the method has no scheduler."""
    turns = [counts for a in answers for counts in choice(a).get("scheduler", [])]
    if not turns:
        return None
    total: dict = {"choices": {}, "drafted": {}, "accepted": {}, "lookahead": {}}
    for counts in turns:
        for group in total:
            for key, value in counts[group].items():
                total[group][key] = total[group].get(key, 0) + value
    steps = sum(total["choices"].values())
    total["choice_share"] = {key: round(n / steps, 4) for key, n in total["choices"].items()} if steps else {}
    total["acceptance"] = {key: round(total["accepted"][key] / n, 4) for key, n in total["drafted"].items() if n}
    total["estimates"] = turns[-1]["estimates"]
    return total


OFFLOAD_SUMS = ("bytes_read", "layers_read", "read_s", "stall_s", "stalls", "acquires", "out_of_order")


def offload_totals(answers: Sequence[dict]) -> dict | None:
    """Layer streaming counters summed over every turn (hidden fraction recomputed from the sums); None when no
    layer streamed."""
    turns = [counts for a in answers for counts in choice(a).get("offload", [])]
    if not turns:
        return None
    total = {key: sum(counts[key] for counts in turns) for key in OFFLOAD_SUMS}
    total["decode_s"] = round(sum(counts.get("decode_s", 0.0) for counts in turns), 4)  # absent in older answers
    total["read_s"], total["stall_s"] = round(total["read_s"], 4), round(total["stall_s"], 4)
    hidden = 1 - total["stall_s"] / total["read_s"] if total["read_s"] > 0 else 0.0
    total.update(hidden_fraction=round(min(1.0, max(0.0, hidden)), 4),
                 read_mb_per_s=round(total["bytes_read"] / 2**20 / total["read_s"], 1) if total["read_s"] else None,
                 streamed_layers=turns[-1]["streamed_layers"], io=turns[-1]["io"],
                 head_streamed=bool(turns[-1].get("head_streamed")))
    return total


def within_budget(peak_rss_mb: float | None, budget_mb: float | None, baseline_mb: float | None) -> bool | None:
    """The bound a budgeted run is held to: peak RSS <= budget x 1.1 + the runtime baseline."""
    if peak_rss_mb is None or budget_mb is None or baseline_mb is None:
        return None
    return peak_rss_mb <= budget_mb * 1.1 + baseline_mb


def exact_match(method_answers: Sequence[dict], reference_answers: Sequence[dict]) -> float | None:
    """Fraction of the questions the reference answered whose answer by the method has exactly the reference's
    tokens (a failed question counts as a mismatch)."""
    reference = {a["question_id"]: answer_tokens(a) for a in ok(reference_answers)}
    if not reference:
        return None
    mine = {a["question_id"]: answer_tokens(a) for a in ok(method_answers)}
    return sum(mine.get(qid) == tokens for qid, tokens in reference.items()) / len(reference)


def prefix_agreement(method_answers: Sequence[dict], reference_answers: Sequence[dict]) -> float | None:
    """Mean over the questions the reference answered of the fraction of the reference's tokens (all turns, in
    order) that the method reproduced before its first differing token (a failed question counts 0)."""
    reference = {a["question_id"]: [t for turn in choice(a)["token_ids"] for t in turn]
                 for a in ok(reference_answers) if "token_ids" in choice(a)}
    if not reference:
        return None
    mine = {a["question_id"]: [t for turn in choice(a).get("token_ids", []) for t in turn] for a in ok(method_answers)}
    fractions = []
    for qid, tokens in reference.items():
        other, same = mine.get(qid, []), 0
        while same < min(len(tokens), len(other)) and tokens[same] == other[same]:
            same += 1
        fractions.append(same / len(tokens) if tokens else float(not other))
    return float(np.mean(fractions))


def categories(answers: dict[str, list[dict]]) -> list[str]:
    """Categories in order of first appearance."""
    seen: dict[str, None] = {}
    for method_answers in answers.values():
        for answer in method_answers:
            seen.setdefault(answer["category"], None)
    return list(seen)


def pick_baseline(answers: dict[str, list[dict]]) -> str | None:
    """The faster (by Spec-Bench's mean tokens/s) of ``ar`` and ``hf-ar`` among the methods that answered."""
    speeds = {name: mean_speed(ok(answers[name])) for name in BASELINE_CANDIDATES if ok(answers.get(name, []))}
    return max(speeds, key=speeds.get) if speeds else None


def pick_reference(answers: dict[str, list[dict]]) -> str | None:
    return next((name for name in REFERENCE_CANDIDATES if ok(answers.get(name, []))), None)


def _round(value: float | None, digits: int) -> float | None:
    return round(value, digits) if value is not None else None


def summarize(
    answers: dict[str, list[dict]],
    run: dict,
    peak_rss_mb: dict[str, float | None] | None = None,
    settings: dict[str, dict] | None = None,
    skipped: dict[str, str] | None = None,
    acceptance: dict[str, str] | None = None,
    memory: dict[str, dict] | None = None,
) -> dict:
    """The ``summary.json`` object.

    ``run`` holds the run's settings (``model``, ``dtype``, ``threads``, ``questions``, ``max_new_tokens``,
    ``temperature`` (default 0), ``acceptance`` (default ``exact``), ``memory_budget_mb`` / ``runtime_baseline_mb``
    when known, and any others to record); ``answers`` maps each method that ran to its answers (same questions, same
    order); ``acceptance`` each method's acceptance label (default: the run's); ``memory`` holds what a budgeted
    run's workers measured per method (plan, bytes read from storage, page cache held at the end)."""
    baseline = pick_baseline(answers)
    sampled = run.get("temperature", 0) > 0
    reference = None if sampled else pick_reference(answers)
    summary = dict(run)
    summary.setdefault("temperature", 0.0)
    summary.setdefault("acceptance", "exact")
    summary.update(baseline=baseline, exact_match_reference=reference, skipped=dict(skipped or {}), methods={})
    for name, method_answers in answers.items():
        good = ok(method_answers)
        ratio, aggregate = speedup(method_answers, answers[baseline]) if baseline else (None, None)
        entry = {
            "acceptance": (acceptance or {}).get(name, summary["acceptance"]),
            "tokens_per_s": _round(mean_speed(good), 3),
            "tokens_per_s_aggregate": _round(aggregate_speed(good), 3),
            "speedup": _round(ratio, 4),
            "speedup_aggregate": _round(aggregate, 4),
            "mean_accepted": _round(mean_accepted(good), 4),
            "tokens_per_forward": _round(tokens_per_forward(good), 4),
            "draft_acceptance": _round(draft_acceptance(good), 4),
            "new_tokens": sum(sum(choice(a)["new_tokens"]) for a in good),
            "wall_s": round(sum(sum(choice(a)["wall_time"]) for a in good), 4),
            "peak_rss_mb": (peak_rss_mb or {}).get(name),
            "exact_match": _round(exact_match(method_answers, answers[reference]), 4) if reference else None,
            "prefix_agreement": _round(prefix_agreement(method_answers, answers[reference]), 4) if reference else None,
            "failures": len(method_answers) - len(good),
            "errors": {str(a["question_id"]): a["error"] for a in method_answers if a.get("error")},
            "settings": (settings or {}).get(name, {}),
            "per_category": {},
        }
        shallow = shallow_totals(good)
        if shallow is not None:
            entry["shallow"] = shallow
        scheduler = scheduler_totals(good)
        if scheduler is not None:
            entry["scheduler"] = scheduler
        offload = offload_totals(good)
        if offload is not None:
            entry["offload"] = offload
        if run.get("memory_budget_mb") is not None:
            entry["within_budget"] = within_budget(entry["peak_rss_mb"], run["memory_budget_mb"],
                                                   run.get("runtime_baseline_mb"))
        if memory and name in memory:
            entry["memory"] = memory[name]
            if memory[name].get("cgroup"):  # under --memory-limit: the kernel's own count for the method's cgroup
                entry["peak_memory_mb"] = memory[name]["cgroup"]["peak_memory_mb"]
        for category in categories(answers):
            in_category = [a for a in method_answers if a["category"] == category]
            if not in_category:
                continue
            cat_ratio, cat_aggregate = (speedup(in_category, [a for a in answers[baseline] if a["category"] == category])
                                        if baseline else (None, None))
            entry["per_category"][category] = {
                "speedup": _round(cat_ratio, 4),
                "speedup_aggregate": _round(cat_aggregate, 4),
                "tokens_per_s": _round(mean_speed(ok(in_category)), 3),
                "mean_accepted": _round(mean_accepted(ok(in_category)), 4),
            }
        summary["methods"][name] = entry
    return summary
