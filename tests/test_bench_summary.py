"""Summary numbers on hand-written answer files, checked against values computed by hand."""

import json

import pytest

from cats.bench.answers import read_answers
from cats.bench.report import render_report
from cats.bench.summary import summarize

SUMMARY_KEYS = {"model", "dtype", "threads", "questions", "max_new_tokens", "methods"}
METHOD_KEYS = {"tokens_per_s", "speedup", "mean_accepted", "new_tokens", "wall_s", "peak_rss_mb", "exact_match",
               "per_category", "speedup_aggregate", "failures"}


def answer(qid, category, new_tokens, wall_time, accept_lengths, token_ids=None, error=None):
    token_ids = token_ids if token_ids is not None else [list(range(n)) for n in new_tokens]
    return {"question_id": qid, "category": category, "model_id": "m", "error": error,
            "choices": [{"index": 0, "turns": ["t"] * len(new_tokens), "token_ids": token_ids,
                         "new_tokens": new_tokens, "wall_time": wall_time, "accept_lengths": accept_lengths}]}


def write_answers(path, answers):
    path.write_text("".join(json.dumps(a) + "\n" for a in answers))
    return read_answers(path)


RUN = {"model": "tiny", "dtype": "float32", "threads": 1, "questions": 2, "max_new_tokens": 8}


@pytest.fixture
def answers(tmp_path):
    # baseline ar: q1 10 tokens in 2 s (5 tok/s), q2 two turns 4+6 tokens in 1+1 s (5 tok/s)
    ar = write_answers(tmp_path / "ar.jsonl", [
        answer(1, "writing", [10], [2.0], [1] * 9),
        answer(2, "math", [4, 6], [1.0, 1.0], [1] * 8),
    ])
    # pld: q1 10 tokens in 1 s (10 tok/s), q2 10 tokens in 4 s (2.5 tok/s); q2's second turn differs from ar
    pld = write_answers(tmp_path / "pld.jsonl", [
        answer(1, "writing", [10], [1.0], [3, 3, 3]),
        answer(2, "math", [4, 6], [1.0, 3.0], [1, 2, 1, 4], token_ids=[[0, 1, 2, 3], [0, 1, 2, 3, 4, 9]]),
    ])
    # hf-ar: slower than ar (4 tok/s and 5 tok/s), so ar stays the baseline
    hf_ar = write_answers(tmp_path / "hf-ar.jsonl", [
        answer(1, "writing", [10], [2.5], [1] * 9),
        answer(2, "math", [4, 6], [1.0, 1.0], [1] * 8),
    ])
    return {"ar": ar, "hf-ar": hf_ar, "pld": pld}


def test_speedup_and_mean_accepted_by_hand(answers):
    summary = summarize(answers, RUN, peak_rss_mb={"ar": 100.0})
    assert SUMMARY_KEYS <= set(summary) and summary["baseline"] == "ar" and summary["acceptance"] == "exact"
    pld = summary["methods"]["pld"]
    assert METHOD_KEYS <= set(pld)
    # Spec-Bench: mean(10, 2.5) / mean(5, 5) = 6.25 / 5 = 1.25
    assert pld["tokens_per_s"] == pytest.approx(6.25)
    assert pld["speedup"] == pytest.approx(1.25)
    # aggregate: (20 tokens / 5 s) / (20 tokens / 4 s) = 4 / 5
    assert pld["speedup_aggregate"] == pytest.approx(0.8)
    # pooled accept lengths: (3+3+3+1+2+1+4) / 7 = 17 / 7
    assert pld["mean_accepted"] == pytest.approx(17 / 7, abs=1e-4)
    assert pld["new_tokens"] == 20 and pld["wall_s"] == pytest.approx(5.0)
    assert pld["exact_match"] == 0.5 and pld["failures"] == 0
    assert pld["per_category"]["writing"] == {"speedup": 2.0, "speedup_aggregate": 2.0, "tokens_per_s": 10.0,
                                              "mean_accepted": 3.0}
    assert pld["per_category"]["math"]["speedup"] == pytest.approx(0.5)
    assert summary["methods"]["ar"]["speedup"] == 1.0 and summary["methods"]["ar"]["peak_rss_mb"] == 100.0
    # hf-ar: mean(4, 5) / 5 = 0.9
    assert summary["methods"]["hf-ar"]["speedup"] == pytest.approx(0.9)


def test_faster_of_ar_and_hf_ar_is_the_baseline(answers):
    answers["hf-ar"][0]["choices"][0]["wall_time"] = [1.0]  # now 10 tok/s on q1: faster than ar
    summary = summarize(answers, RUN)
    assert summary["baseline"] == "hf-ar" and summary["exact_match_reference"] == "ar"
    assert summary["methods"]["hf-ar"]["speedup"] == 1.0
    assert summary["methods"]["ar"]["speedup"] == pytest.approx(5 / 7.5, abs=1e-4)


def test_failures_are_counted_and_left_out(answers):
    answers["pld"][1] = answer(2, "math", [4], [1.0], [1, 1, 2], error="RuntimeError: boom")
    summary = summarize(answers, RUN)
    pld = summary["methods"]["pld"]
    assert pld["failures"] == 1 and pld["errors"] == {"2": "RuntimeError: boom"}
    # only q1 is compared: 10 tok/s vs 5 tok/s
    assert pld["speedup"] == pytest.approx(2.0) and pld["mean_accepted"] == 3.0
    assert pld["exact_match"] == 0.5  # q1 equal, q2 failed
    assert pld["per_category"]["math"]["speedup"] is None
    assert "failed on 1 question" in render_report(summary)


def test_no_baseline_without_ar_or_hf_ar(answers):
    summary = summarize({"pld": answers["pld"]}, RUN)
    assert summary["baseline"] is None and summary["methods"]["pld"]["speedup"] is None
    assert summary["methods"]["pld"]["exact_match"] is None
    report = render_report(summary)
    assert "neither ar nor hf-ar ran" in report and "| pld |" in report


def test_report_has_a_table_per_category_and_states_greedy(answers):
    report = render_report(summarize(answers, RUN), ["ar", "pld", "llama-cpp"])
    assert "## writing" in report and "## math" in report and "**greedy**" in report
    assert "8-bit activations" in report  # how llama.cpp computes is explained when it was asked for


def test_shallow_counters_are_summed_over_turns():
    from cats.bench.summary import shallow_totals
    from cats.verify.cascade import ShallowCounts

    first = ShallowCounts(true_positive=3, false_positive=1, true_negative=2, false_negative=0, nodes_drafted=6,
                          nodes_pruned=2, steps=2).to_dict()
    second = ShallowCounts(true_positive=1, false_positive=1, true_negative=0, false_negative=2, nodes_drafted=4,
                           nodes_pruned=2, steps=1).to_dict()
    answers = [{"choices": [{"shallow": [first]}]}, {"choices": [{"shallow": [second]}]}]
    total = shallow_totals(answers)
    assert (total["true_positive"], total["false_positive"], total["false_negative"]) == (4, 2, 2)
    assert total["precision"] == round(4 / 6, 4) and total["recall"] == round(4 / 6, 4)
    assert total["keep_rate"] == 0.6 and total["steps"] == 3
    assert shallow_totals([{"choices": [{}]}]) is None


def test_tokens_per_forward_and_draft_acceptance_by_hand():
    """A server that reports no accept lengths: turns of 9 and 5 new tokens in 1 + 3 and 1 + 2 target forwards are
    (8 + 4) / (3 + 2) = 2.4 tokens per forward; 12 drafted, 7 accepted = 7/12."""
    served = answer(1, "writing", [9, 5], [1.0, 1.0], [])
    served["choices"][0].update(decoding_steps=[4, 3], drafts=[[8, 5], [4, 2]])
    plain = answer(1, "writing", [9, 5], [2.0, 2.0], [1] * 12)
    plain["choices"][0]["decoding_steps"] = [9, 5]
    methods = summarize({"ar": [plain], "llama-server-eagle3": [served]}, RUN)["methods"]
    entry = methods["llama-server-eagle3"]
    assert entry["mean_accepted"] is None and entry["tokens_per_forward"] == pytest.approx(2.4)
    assert entry["draft_acceptance"] == pytest.approx(7 / 12, abs=1e-4)
    assert methods["ar"]["tokens_per_forward"] == pytest.approx(1.0) and methods["ar"]["draft_acceptance"] is None
