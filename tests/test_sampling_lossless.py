"""Sampling is lossless end to end: through the real decode loop, the first 3 generated tokens of every speculative
method follow plain sampling's exact distribution (enumerated with transformers' forward) on tiny float64 models,
and the same check fails for a broken acceptance rule. Same seed, same output, for every method. Typical acceptance
is labelled lossy everywhere."""

from __future__ import annotations

import pytest
import torch

from cats.verify.acceptance import SpeculativeSampling
from cats.verify.cascade import CascadeScorer
from cats.draft import EarlyExitDrafter, PromptLookupDrafter, TreeDrafter
from cats.model.adapter import new_adapter
from cats.draft.eagle import FeatureDrafter
from cats.errors import InvalidArgumentError
from cats.config import GenerationConfig
from cats.loop.generator import Generator
from tests.conftest import tiny_model
from tests.test_draft_feature import feature_adapter
from tests.stats_helpers import first_tokens_distribution, sequence_pvalue

RUNS = 300
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
LOOKUP_PROMPT = [83, 78, 64, 4, 93, 90, 24, 4, 83, 78, 64, 4]  # the undamped model often continues it as before
TOP2 = dict(temperature=1.0, top_k=2)
NUCLEUS = dict(temperature=0.8, top_p=0.3)


@pytest.fixture(scope="module")
def damped():
    return tiny_model("llama", damp=0.5)  # shallow exits often, not always, agree with the full model


@pytest.fixture(scope="module")
def undamped():
    return tiny_model("llama")


class NoResidual(SpeculativeSampling):
    """Mutant: after a rejection, sample from p instead of norm(max(p - q, 0))."""

    @staticmethod
    def residual(p, q):
        return p


def cascade(model):
    torch.manual_seed(0)
    drafter = TreeDrafter(model, adapter=new_adapter(model, "draft", 1), tree_topk=2, total_tokens=4, depth=2)
    return drafter, CascadeScorer(model, new_adapter(model, "shallow", 3), drafter=drafter, sv_threshold=0.3)


def sample_runs(model, drafter, prompt, warping, scorer=None, acceptance=None, runs=RUNS):
    """The first 3 tokens of ``runs`` generations of 4 tokens (the first decode step may then draft 2 tokens and
    test both), seeds 0..runs-1; and the summed stats."""
    generator = Generator(model, drafter, scorer=scorer, acceptance=acceptance)
    samples, accepted, drafted, pruned = [], 0, 0, 0
    for seed in range(runs):
        result = generator.generate(prompt, GenerationConfig(max_new_tokens=4, ignore_eos=True, seed=seed, **warping))
        samples.append(tuple(result.token_ids[:3]))
        accepted += result.stats.accepted_draft_tokens
        drafted += result.stats.drafted_tokens
        pruned += (result.stats.shallow or {}).get("nodes_pruned", 0)
    return samples, accepted, drafted, pruned


CASES = {
    "ar": ("damped", None, PROMPT, TOP2),
    "early-exit": ("damped", lambda m: (EarlyExitDrafter(m, layer=1, num_tokens=2), None), PROMPT, TOP2),
    "tree": ("damped", lambda m: (TreeDrafter(m, layer=1, tree_topk=2, total_tokens=4, depth=2), None), PROMPT,
             NUCLEUS),
    "cats": ("damped", cascade, PROMPT, TOP2),
    "eagle": ("damped", lambda m: (FeatureDrafter(m, feature_adapter(m), depth=2), None), PROMPT, TOP2),
    "pld": ("undamped", lambda m: (PromptLookupDrafter(num_tokens=2), None), LOOKUP_PROMPT, TOP2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_first_tokens_follow_plain_sampling(case, request):
    family, make, prompt, warping = CASES[case]
    model = request.getfixturevalue(family)
    drafter, scorer = make(model) if make else (None, None)
    exact = first_tokens_distribution(model, prompt, 3, **warping)
    samples, accepted, drafted, pruned = sample_runs(model, drafter, prompt, warping, scorer)
    assert sequence_pvalue(samples, exact) > 1e-3, case
    if drafter is not None:  # drafts were really accepted and really rejected
        assert 0 < accepted < drafted, (case, accepted, drafted)
    if case == "cats":
        assert pruned > 0  # the shallow verifier pruned drawn nodes (they stay unverified candidates)


def test_the_check_fails_for_a_broken_rule(damped):
    exact = first_tokens_distribution(damped, PROMPT, 3, **TOP2)
    samples, *_ = sample_runs(damped, EarlyExitDrafter(damped, layer=1, num_tokens=2), PROMPT, TOP2,
                              acceptance=NoResidual())
    assert sequence_pvalue(samples, exact) < 1e-6


def every_method(model):
    yield None, None
    yield PromptLookupDrafter(num_tokens=3), None
    yield EarlyExitDrafter(model, layer=1, num_tokens=3), None
    yield TreeDrafter(model, layer=1, tree_topk=3, total_tokens=8, depth=3), None
    yield cascade(model)


def test_same_seed_same_output_for_every_method(damped):
    warping = dict(temperature=0.9, top_p=0.95, top_k=40)
    for drafter, scorer in every_method(damped):
        generator = Generator(damped, drafter, scorer=scorer)
        outputs = {}
        for seed in (3, 3, 4, 5):
            config = GenerationConfig(max_new_tokens=16, ignore_eos=True, seed=seed, **warping)
            outputs.setdefault(seed, []).append(generator.generate(PROMPT, config).token_ids)
        name = drafter.name if drafter else "ar"
        assert outputs[3][0] == outputs[3][1], name
        assert len({tuple(outputs[seed][0]) for seed in (3, 4, 5)}) > 1, name  # the seed matters


def test_deterministic_drafts_reproduce_plain_sampling_token_for_token(damped):
    """Drafts chosen deterministically (prompt lookup, layer skipping's chains and trees, DyTC, whose timing-driven choices vary from run
    to run) are one-hot candidates: the target's samples are keyed by seed and position, so the output is exactly
    plain sampling's for the same seed."""
    from cats.draft import LayerSkipDrafter, SkipSet
    from cats.draft.dytc.scheduler import DraftOption, DyTCDrafter
    from tests.test_dytc import cycling

    adapter = new_adapter(damped, "draft", 1)
    skip = LayerSkipDrafter(damped, SkipSet(attention=(2,), mlp=(1,)), num_tokens=4,
                            assist=PromptLookupDrafter(num_tokens=4))
    options = [DraftOption("skip", skip, 4, 0.7, 0.5),
               DraftOption("chain", EarlyExitDrafter(damped, adapter=adapter, num_tokens=4), 4, 0.8, 0.4),
               DraftOption("tree", TreeDrafter(damped, adapter=adapter, tree_topk=2, total_tokens=6, depth=3), 6, 0.8,
                           0.3, tree=True)]
    skip_tree = LayerSkipDrafter(damped, SkipSet(attention=(2,), mlp=(1,)), num_tokens=3, tree_topk=2, total_tokens=6)
    timed = DyTCDrafter(options, lookup=PromptLookupDrafter(num_tokens=6), lookahead_tokens=3)
    forced = cycling(DyTCDrafter(options, lookup=PromptLookupDrafter(num_tokens=6), lookahead_tokens=3))
    accepted, chosen = {}, {}
    for warping in (TOP2, dict(temperature=0.9, top_p=0.95)):
        for seed in (1, 2):
            config = GenerationConfig(max_new_tokens=24, ignore_eos=True, seed=seed, **warping)
            expected = Generator(damped).generate(PROMPT, config).token_ids
            for name, drafter in (("pld", PromptLookupDrafter(num_tokens=3)), ("skip", skip), ("skip-tree", skip_tree),
                                  ("timed", timed), ("forced", forced)):
                result = Generator(damped, drafter).generate(PROMPT, config)
                assert result.token_ids == expected, (name, seed, warping)
                accepted[name] = accepted.get(name, 0) + result.stats.accepted_draft_tokens
                if name == "forced":
                    for key, count in result.stats.scheduler["choices"].items():
                        chosen[key] = chosen.get(key, 0) + count
    assert all(accepted[name] > 0 for name in ("skip", "skip-tree", "timed", "forced")), accepted  # not vacuous
    assert all(chosen[key] > 0 for key in ("skip", "chain", "tree")), chosen  # the adapter drafts ran too


def test_typical_acceptance_is_opt_in_and_labelled_lossy(damped):
    drafter = EarlyExitDrafter(damped, layer=1, num_tokens=3)
    exact = Generator(damped, drafter).generate(PROMPT, GenerationConfig(max_new_tokens=24, ignore_eos=True,
                                                                           temperature=0.7, seed=1))
    typical = Generator(damped, drafter).generate(PROMPT, GenerationConfig(
        max_new_tokens=24, ignore_eos=True, temperature=0.7, seed=1, acceptance="typical", typical_tau=0.2))
    assert exact.stats.acceptance == "exact" and exact.stats.lossless
    stats = typical.stats.to_dict()
    assert stats["acceptance"] == "typical (lossy)" and not stats["lossless"]
    assert (stats["typical_tau"], stats["typical_alpha"]) == (0.2, 0.3) and stats["temperature"] == 0.7
    line = typical.stats.summary_line()
    assert "acceptance: typical (lossy) tau 0.2 alpha 0.3, temperature 0.7, seed 1" in line
    assert typical.stats.mean_accepted > exact.stats.mean_accepted  # why anyone would accept the loss
    with pytest.raises(InvalidArgumentError, match="plain decoding"):
        Generator(damped).generate(PROMPT, GenerationConfig(temperature=0.7, acceptance="typical"))
    with pytest.raises(InvalidArgumentError, match="typical_alpha applies to typical acceptance only"):
        Generator(damped, drafter).generate(PROMPT, GenerationConfig(temperature=0.7, typical_alpha=0.2))


def test_sampled_stats_record_the_warping_and_the_seed(damped):
    result = Generator(damped, PromptLookupDrafter()).generate(PROMPT, GenerationConfig(
        max_new_tokens=8, temperature=0.9, top_p=0.8, top_k=20, seed=12))
    stats = result.stats.to_dict()
    assert {k: stats[k] for k in ("acceptance", "temperature", "top_p", "top_k", "seed", "lossless")} == dict(
        acceptance="exact", temperature=0.9, top_p=0.8, top_k=20, seed=12, lossless=True)
    assert "[pld, acceptance: exact, temperature 0.9, top-p 0.8, top-k 20, seed 12]" in result.stats.summary_line()
    torch.manual_seed(0)
    unseeded = Generator(damped).generate(PROMPT, GenerationConfig(max_new_tokens=8, temperature=0.9))
    assert unseeded.stats.seed is not None  # the drawn seed is reported, so the run can be repeated
    again = Generator(damped).generate(PROMPT, GenerationConfig(max_new_tokens=8, temperature=0.9,
                                                                seed=unseeded.stats.seed))
    assert again.token_ids == unseeded.token_ids


def test_an_explicit_sampling_rule_needs_a_temperature(damped):
    with pytest.raises(InvalidArgumentError, match="samples: set temperature > 0"):
        Generator(damped, PromptLookupDrafter(), acceptance=SpeculativeSampling()).generate(PROMPT, GenerationConfig())
