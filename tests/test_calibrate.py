"""Skip-set calibration: the agreement objective, the search on constructed cases, the JSON cache and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from cats.cache_files import write_json
from cats.draft import SkipSet
from cats.draft.layer_skip import calibration as cal
from cats.errors import InvalidArgumentError
from tests.conftest import STORIES_HF, VOCAB, needs, tiny_model


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CATS_CACHE", str(tmp_path / "cache"))


def damped_model(layers=(1, 2), factor=1e-4, seed=0):
    """A tiny Llama whose ``layers`` barely change the residual stream: skipping their four sublayers is nearly
    free, skipping any other sublayer is not."""
    model = tiny_model("llama", seed=seed)
    with torch.no_grad():
        for i in layers:
            model.layers[i].self_attn.o_proj.weight.mul_(factor)
            model.layers[i].mlp.down_proj.weight.mul_(factor)
    return model


def token_prompts(count=4, length=10):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for _ in range(count)]


def test_probe_agrees_with_drafting_from_an_exact_prefix():
    """Agreement of the full model is 1; of a skip set, it equals running the skip model one token at a time after
    the exact prefix (what a one-token draft sees)."""
    model = tiny_model("llama", damp=0.3)
    prompts = token_prompts(2, 8)
    probe = cal.AgreementProbe(model, prompts, tokens=4)
    assert probe.full_agreement == 1.0 and probe.agreement(SkipSet()) == 1.0 and probe.num_positions == 8
    skip = SkipSet(attention=(1,), mlp=(2, 3))
    from cats.draft.layer_skip.drafter import SkipModel

    hits = 0
    for row, (token, position, target) in enumerate(zip(probe.query_tokens, probe.query_positions, probe.targets)):
        owner = row // 4
        sequence = probe.tokens[sum(len(p) + 3 for p in prompts[:owner]):][: int(position)]
        cache = model.new_cache()
        model.forward_layers(model.embed(sequence), 0, model.num_layers, cache)
        hidden = SkipModel(model, skip).forward(token.view(1), cache, position.view(1))
        hits += int(model.head(hidden[0, -1]).argmax() == target)
    assert 0 < hits < 8 and probe.agreement(skip) == pytest.approx(hits / 8)
    assert probe.cache.length(0) == probe.tokens.numel()  # the probe's slots were cropped off again


def test_search_finds_the_identity_like_sublayers():
    model = damped_model()
    [result] = cal.calibrate(model, [0.5], prompts=token_prompts(), tokens=12, budget=20, save=False)
    assert result.skip == SkipSet(attention=(1, 2), mlp=(1, 2))
    probe = cal.AgreementProbe(model, token_prompts(), 12)
    assert result.agreement == probe.agreement(result.skip) > probe.agreement(SkipSet(attention=(0, 3), mlp=(0, 3)))
    assert result.agreement > 0.9


def test_local_search_repairs_a_misleading_scan():
    """Single-sublayer scores point at sublayers 0 and 1, but only {2, 3} together is good: the swaps find it."""
    target = {2, 3}

    def score(skip: SkipSet) -> float:
        chosen = set(skip.sublayers())
        return 1.0 if chosen == target else 0.5 * len(chosen & target) / len(target)

    scan = [0.9, 0.9, 0.1, 0.1, 0.2, 0.2, 0.3, 0.3]
    skip, value, scored = cal.search_skip_set(score, 4, 2, scan, budget=60, seed=0)
    assert set(skip.sublayers()) == target and value == 1.0 and scored <= 61
    skip, value, _ = cal.search_skip_set(score, 4, 2, scan, budget=0)
    assert set(skip.sublayers()) == {0, 1}  # without a budget: the scan's choice


def test_results_are_cached_per_model_and_reloaded(monkeypatch):
    model = damped_model()
    first = cal.calibrate(model, [0.25, 0.5], prompts=token_prompts(), tokens=8, budget=5)
    path = cal.skip_set_file(model)
    data = json.loads(path.read_text())
    assert data["model"]["fingerprint"] == path.stem and set(data["skip_sets"]) == {"0.25", "0.5"}
    assert data["skip_sets"]["0.5"]["skipped"] == first[1].skip.to_dict()

    def no_search(*args, **kwargs):
        raise AssertionError("recalibrated although cached")

    monkeypatch.setattr(cal, "AgreementProbe", no_search)
    again = cal.calibrate(model, [0.5], prompts=token_prompts(), tokens=8, budget=5)  # same settings: cached
    assert again[0].skip == first[1].skip and again[0].agreement == first[1].agreement
    assert cal.load_or_calibrate(model, 0.25).skip == first[0].skip
    other = tiny_model("llama", seed=4)  # another lm_head: another fingerprint, nothing cached
    assert cal.load_cached(other) == {}
    with pytest.raises(AssertionError, match="recalibrated"):
        cal.load_or_calibrate(other, 0.5, progress=False)
    with pytest.raises(AssertionError, match="recalibrated"):  # other settings: recalibrated
        cal.calibrate(model, [0.5], prompts=token_prompts(), tokens=8, budget=6)
    data.pop("crc32")
    data["model"]["fingerprint"] = "0" * 16  # a file that claims another model is ignored
    write_json(path, data)
    assert cal.load_cached(model) == {}


def test_bad_arguments():
    model = tiny_model("llama")
    with pytest.raises(InvalidArgumentError, match=r"sparsity must lie in \(0, 1\)"):
        cal.calibrate(model, [1.0], prompts=token_prompts())
    with pytest.raises(InvalidArgumentError, match="at least 2 continuation tokens"):
        cal.calibrate(model, [0.5], prompts=token_prompts(), tokens=1)
    with pytest.raises(InvalidArgumentError, match="has no tokenizer"):
        cal.calibrate(model, [0.5])


@needs(STORIES_HF)
def test_calibrate_command(capsys, tmp_path):
    from cats.cli import main

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"conversations": [{"from": "human", "value": f"Once upon a time, {w}"}]}
                                   for w in ("a cat", "a dog", "the sun")]))
    argv = ["calibrate", "--model", str(STORIES_HF), "--sparsity", "0.4", "--prompts", str(prompts),
            "--num-prompts", "2", "--tokens", "8", "--budget", "4", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "sparsity 0.4: skip 4 of 10 sublayers" in out and "agreement with the full model" in out
    assert "cached in" in out and str(prompts) in out
    path = out.strip().splitlines()[-1].removeprefix("cached in ")
    assert json.loads(open(path).read())["skip_sets"]["0.4"]["settings"]["prompts"] == str(prompts)
    assert main(["calibrate", "--model", str(STORIES_HF), "--sparsity", "0.4,1.5"]) == 2
    assert "sparsity must lie in (0, 1), got 1.5" in capsys.readouterr().err
    # generation uses the cached skip set (no new calibration), and stays lossless
    tokens = {}
    for method in ("ar", "layer-skip", "dytc"):
        extra = ["--sparsity", "0.4"] if method != "ar" else []
        assert main(["generate", "--model", str(STORIES_HF), "--prompt", "Once upon a time", "--method", method,
                     "--max-new-tokens", "24", "--stats", "--json", *extra]) == 0
        captured = capsys.readouterr()
        assert "calibrating" not in captured.err and f"[{method}, acceptance: exact, greedy]" in captured.err
        tokens[method] = json.loads(captured.out.strip().splitlines()[-1])["token_ids"]
    assert tokens["ar"] == tokens["layer-skip"] == tokens["dytc"]
    assert "scheduler: chose" in captured.err


@pytest.mark.parametrize("path", sorted(cal.SHIPPED.glob("*.json")), ids=lambda p: p.stem)
def test_each_shipped_skip_set_file_is_found_by_its_models_fingerprint_and_reads(path):
    """The skip sets shipped with CATS: named by the fingerprint they hold, in the cache's format, each sparsity's
    skipped sublayers inside the model and as many as the sparsity asks."""
    data = json.loads(path.read_text())
    assert data["format"] == cal.FORMAT
    assert data["model"]["fingerprint"] == path.stem
    layers = data["model"]["num_layers"]
    assert data["skip_sets"]
    for key, entry in data["skip_sets"].items():
        result = cal.CalibrationResult.from_dict(entry)
        assert key == cal._sparsity_key(result.sparsity)
        result.skip.validate(layers)
        skipped = len(result.skip.attention) + len(result.skip.mlp)
        assert skipped == cal.skip_size(result.sparsity, layers)
        assert 0.0 < result.agreement <= 1.0
