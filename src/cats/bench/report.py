"""``report.md``: the run's settings, one table over all questions and one table per category."""

from __future__ import annotations

from cats.bench.methods import LLAMA_CPP_METHODS, LLAMA_CPP_WEIGHTS_NOTE
from cats.model.weights import layer_ranges


def _cell(value, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def _percent(value) -> str:
    return "–" if value is None else f"{value:.0%}"


def _decoding(summary: dict) -> str:
    """The run's decoding and acceptance, in words."""
    temperature, acceptance = summary.get("temperature", 0.0), summary.get("acceptance", "exact")
    if temperature > 0:
        warping = ", ".join([f"temperature {temperature:g}"]
                            + ([f"top-p {summary['top_p']:g}"] if summary.get("top_p", 1.0) < 1 else [])
                            + ([f"top-k {summary['top_k']}"] if summary.get("top_k", 0) else []))
        decoding = (f"decoding: **sampled** ({warping}; per-turn seeds from base seed {summary.get('seed')}, the same "
                    "for every method); exact acceptance keeps plain sampling's distribution, so outputs are not "
                    "compared token for token")
    else:
        decoding = "decoding: **greedy** (temperature 0: exact acceptance must produce the tokens of plain greedy " \
                   "decoding)"
    if acceptance != "exact":
        decoding += (f"; **{acceptance}** acceptance (tau {summary.get('typical_tau')}, alpha "
                     f"{summary.get('typical_alpha')}) for CATS's speculative methods: their outputs drift from the "
                     "target's; ar and the baselines decode exactly")
    return f"acceptance mode: **{acceptance}**; {decoding}"


def render_report(summary: dict, requested_methods: list[str] | None = None) -> str:
    methods = summary["methods"]
    baseline, reference = summary.get("baseline"), summary.get("exact_match_reference")
    lines = [
        "# cats bench report",
        "",
        f"- model: `{summary['model']}`, dtype {summary['dtype']}, {summary['threads']} threads",
        f"- questions: {summary['questions']} from `{summary.get('question_file', '?')}` "
        f"(turns: {summary.get('turns', 'first')}, prompt format: {summary.get('prompt_format', 'chat')})",
        f"- max new tokens: {summary['max_new_tokens']}; {_decoding(summary)}",
        f"- speedup baseline: {f'`{baseline}`' if baseline else 'none (neither ar nor hf-ar ran)'}; "
        "speedup = mean per-question tokens/s of the method / that of the baseline (Spec-Bench's speed.py), "
        "aggregate = total tokens / total time, ratio to the baseline's",
        f"- exact match: fraction of questions whose tokens equal those of "
        f"{f'`{reference}`' if reference else '(no reference: sampled run, or neither ar nor hf-ar ran)'}; "
        "prefix agreement: mean fraction of the reference's tokens reproduced before the first difference",
        "- mean accepted: tokens committed per target forward after the first (1.00 for plain decoding; llama-server: "
        "its new tokens over its verification rounds, counted from its accepted drafts); drafts accepted: accepted "
        "over drafted tokens, for methods that draft",
        ("- peak RSS: each method ran alone in its own process under the budget; its peak resident memory "
         "(VmHWM, loading included)" if summary.get("memory_budget") else
         f"- peak RSS: the process's peak resident memory while the method ran, {summary.get('peak_rss_method', '')}; "
         "a method in a process of its own (llama-server): that process's peak (VmHWM)"),
        *([f"- memory budget: {summary['memory_budget']} = {summary['memory_budget_mb']:.1f} MiB; runtime baseline "
           f"{summary['runtime_baseline_mb']:.1f} MiB (torch, transformers, CATS, tokenizer, weightless skeleton); "
           "within budget: peak RSS <= budget x 1.1 + baseline"] if summary.get("memory_budget") else
          [f"- runtime baseline: {summary['runtime_baseline_mb']:.1f} MiB (a fresh process with torch, transformers, "
           "CATS, the tokenizer and a weightless model skeleton)"] if summary.get("runtime_baseline_mb") else []),
        "",
        "## All questions",
        "",
        "| method | acceptance | tokens/s | speedup | speedup (aggregate) | mean accepted | drafts accepted "
        "| new tokens | wall s | peak RSS MB | exact match | prefix agreement | failures | weights, kernels |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in methods.items():
        lines.append(
            f"| {name} | {m.get('acceptance', 'exact')} | {_cell(m['tokens_per_s'], 1)} | {_cell(m['speedup'], 2, 'x')} "
            f"| {_cell(m['speedup_aggregate'], 2, 'x')} "
            f"| {_cell(m['mean_accepted'] if m['mean_accepted'] is not None else m.get('tokens_per_forward'))} "
            f"| {_percent(m.get('draft_acceptance'))} | {m['new_tokens']} "
            f"| {_cell(m['wall_s'], 1)} | {_cell(m['peak_rss_mb'], 0)} | {_percent(m['exact_match'])} "
            f"| {_percent(m.get('prefix_agreement'))} | {m['failures']} | {(m.get('settings') or {}).get('weights', '–')} |"
        )
    if summary.get("memory_budget") or any(m.get("offload") for m in methods.values()):
        lines += ["", "## Memory and streaming", "",
                  "| method | peak RSS MB | within budget | streamed layers | read MB | read s | of it decoding s "
                  "| stall s | hidden | storage read MB | page cache MB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, m in methods.items():
            offload, measured = m.get("offload") or {}, m.get("memory") or {}
            layers = offload.get("streamed_layers")
            lines.append(
                f"| {name} | {_cell(m['peak_rss_mb'], 0)} | {_cell(m.get('within_budget'))} "
                f"| {layer_ranges(layers) if layers else '–'}{' + lm_head' if offload.get('head_streamed') else ''} "
                f"| {_cell(offload['bytes_read'] / 2**20, 0) if offload else '–'} | {_cell(offload.get('read_s'), 1)} "
                f"| {_cell(offload.get('decode_s'), 1)} | {_cell(offload.get('stall_s'), 1)} "
                f"| {_percent(offload.get('hidden_fraction'))} "
                f"| {_cell(measured.get('storage_read_mb'), 0)} | {_cell(measured.get('page_cache_mb'), 1)} |")
    if summary.get("memory_limit"):
        lines += ["", f"## Under the memory limit ({summary['memory_limit']} = {summary['memory_limit_mb']:.0f} MiB, "
                  "a memory cgroup each)", "",
                  "Charged as the kernel charges it: anonymous memory and the page cache the process touched "
                  "(a memory-mapped file included); no swap; each method started with the model file's pages "
                  "dropped.", "",
                  "| method | tokens/s | peak charged MB | major faults | read from disk MB | OOM kills | exact match "
                  "| cached at start MB |", "|---|---|---|---|---|---|---|---|"]
        for name, m in methods.items():
            measured = m.get("memory") or {}
            usage = measured.get("cgroup") or {}
            lines.append(f"| {name} | {_cell(m['tokens_per_s'], 2)} | {_cell(usage.get('peak_memory_mb'), 0)} "
                         f"| {_cell(usage.get('major_faults'))} | {_cell(measured.get('process_read_mb'), 0)} "
                         f"| {_cell(usage.get('oom_kills'))} | {_percent(m['exact_match'])} "
                         f"| {_cell(measured.get('cached_at_start_mb'), 0)} |")
    categories = list(dict.fromkeys(cat for m in methods.values() for cat in m["per_category"]))
    for category in categories:
        lines += ["", f"## {category}", "", "| method | tokens/s | speedup | speedup (aggregate) | mean accepted |",
                  "|---|---|---|---|---|"]
        for name, m in methods.items():
            c = m["per_category"].get(category)
            if c is not None:
                lines.append(f"| {name} | {_cell(c['tokens_per_s'], 1)} | {_cell(c['speedup'], 2, 'x')} "
                             f"| {_cell(c['speedup_aggregate'], 2, 'x')} | {_cell(c['mean_accepted'])} |")
    notes = []
    for name, reason in summary.get("skipped", {}).items():
        notes.append(f"- `{name}` was skipped: {reason}")
    for name, m in methods.items():
        if m["failures"]:
            notes.append(f"- `{name}` failed on {m['failures']} question(s): "
                         + "; ".join(f"{qid}: {error}" for qid, error in list(m["errors"].items())[:3]))
    if any(name in LLAMA_CPP_METHODS for name in list(methods) + list(summary.get("skipped", {}))
           + list(requested_methods or [])):
        notes.append("- " + LLAMA_CPP_WEIGHTS_NOTE.format(dtype=summary["dtype"]))
    settings = {name: {k: v for k, v in (m.get("settings") or {}).items() if k not in ("name", "weights")}
                for name, m in methods.items()}
    settings = {name: s for name, s in settings.items() if s}
    if settings:
        notes.append("- method settings: " + "; ".join(
            f"`{name}` " + ", ".join(f"{k}={v}" for k, v in s.items()) for name, s in settings.items()))
    if notes:
        lines += ["", "## Notes", ""] + notes
    return "\n".join(lines) + "\n"
