"""The stream order: which layers a budget streams (the planner's arithmetic on a hand-computed case), its calibration
(greedy and nested, cached), and layer-skip drafting from the resident layers alone while the others stream:
lossless, and no draft token reads a streamed layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cats.config import DraftConfig, GenerationConfig
from cats.draft.layer_skip.calibration import AgreementProbe
from cats.draft.layer_skip.drafter import LayerSkipDrafter
from cats.draft.layer_skip.stream_order import calibrate_stream_order, skip_layers, streamed_skip
from cats.errors import InvalidArgumentError
from cats.loop.generator import Generator
from cats.methods import make_drafter, memory_needs
from cats.model.identity import model_fingerprint, model_identity
from cats.model.weights.budget import MemoryNeeds, PartSizes, layer_ranges, plan_memory, streamed_layers
from cats.model.weights.stream_order import (SHIPPED, StreamOrder, load_stream_order, stream_order_file,
                                             store_stream_order)
from tests.conftest import STORIES_HF, VOCAB, hf_greedy, needs
from tests.test_memory_stream import LAYERS, deep_model, offload

KIB = 1 << 10
NEW_TOKENS = 20


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CATS_CACHE", str(tmp_path / "cache"))


def token_prompts(count=3, length=10, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for _ in range(count)]


def damped(family: str, layers=(5, 6)):
    """`deep_model` with ``layers`` barely changing the residual stream: a draft can skip them nearly for free."""
    model = deep_model(family)
    with torch.no_grad():
        for i in layers:
            model.layers[i].self_attn.o_proj.weight.mul_(1e-4)
            model.layers[i].mlp.down_proj.weight.mul_(1e-4)
    return model


def test_streamed_layers_and_their_ranges():
    assert streamed_layers(6, 2) == (2, 3, 4, 5)  # no order: the deepest
    assert streamed_layers(6, 4, (3, 1, 5)) == (1, 3)  # the first two of the order
    assert streamed_layers(6, 2, (3, 1, 5)) == (1, 3, 4, 5)  # the order, then the deepest of the others
    assert streamed_layers(6, 6, (3, 1)) == ()
    assert layer_ranges((1, 3, 4, 5)) == "[1, 2) [3, 6)" and layer_ranges(()) == "none"


def test_planner_streams_the_first_layers_of_the_order():
    """embeddings 16 KiB, adapters 4, KV 4, activations 8 (32 KiB fixed), six 8 KiB layers, one read ahead: keeping r
    layers costs 32 + 8 r + 8 * min(2, 6 - r) KiB, whichever layers stream."""
    parts = PartSizes(embed=16 * KIB, norm=0, lm_head=0, layers=[8 * KIB] * 6)

    def plan(budget, order=()):
        needs = MemoryNeeds(context_tokens=10, min_resident_layers=1, adapter_bytes=4 * KIB, prefetch=1,
                            stream_order=order)
        return plan_memory(budget, parts, needs, kv_bytes=4 * KIB, activation=8 * KIB)

    ordered, deepest = plan(75 * KIB, (1, 4, 2)), plan(75 * KIB)
    assert ordered.resident_layers == deepest.resident_layers == 3  # 32 + 24 + 16 = 72 KiB: 4 resident need 80
    assert ordered.streamed == (1, 2, 4) and ordered.resident == (0, 3, 5) and ordered.resident_prefix == 1
    assert deepest.streamed == (3, 4, 5) and deepest.resident_prefix == 3
    assert ordered.planned_bytes == deepest.planned_bytes == 72 * KIB and ordered.bytes_per_pass == 24 * KIB
    text = ordered.describe()
    assert "streamed layers [1, 3) [4, 5) (3 of 6): 24.0 KiB read per verification pass" in text
    assert "resident layers [0, 1) [3, 4) [5, 6)" in text and "calibrated stream order" in text
    assert ordered.to_dict()["streamed_layers"] == [1, 2, 4]
    assert plan(79 * KIB, (1, 4, 2)).streamed == (1, 2, 4)  # 4 resident: 32 + 32 + 16 = 80 KiB
    assert plan(80 * KIB, (1, 4, 2)).streamed == ()  # all resident: 32 + 48
    for bad in ((0, 2), (2, 2), (6,)):  # below min_resident_layers, twice, outside the model
        with pytest.raises(InvalidArgumentError, match="stream_order"):
            plan(75 * KIB, bad)
    with pytest.raises(InvalidArgumentError, match="one agreement per layer"):
        MemoryNeeds(min_resident_layers=1, stream_order=(1, 2), stream_agreement=(0.5,)).validate(6)


def test_the_order_is_greedy_nested_and_cached():
    model = damped("llama")
    prompts = token_prompts()
    order = calibrate_stream_order(model, length=3, prompts=prompts, tokens=8, width=LAYERS)
    assert set(order.layers[:2]) == {5, 6} and len(order.layers) == 3 and order.agreement[1] > 0.9
    probe = AgreementProbe(model, prompts, 8)
    for count in (1, 2, 3):  # each agreement is its prefix's, and each step took the best candidate
        assert order.agreement_at(count) == round(probe.agreement(skip_layers(order.layers[:count])), 6)
        for other in set(range(1, LAYERS)) - set(order.layers[:count]):
            other_set = skip_layers([*order.layers[: count - 1], other])
            assert round(probe.agreement(other_set), 6) <= order.agreement[count - 1]
    fingerprint = model_fingerprint(model)
    assert load_stream_order(fingerprint, LAYERS) == order  # cached under the fingerprint
    assert load_stream_order("0" * 16, LAYERS) is None
    path = stream_order_file(fingerprint)
    data = json.loads(path.read_text())
    data["order"]["layers"] = [5, 6, 1]  # edited without its checksum: damaged, removed, not used
    path.write_text(json.dumps(data))
    assert load_stream_order(fingerprint, LAYERS) is None and not path.exists()
    with pytest.raises(InvalidArgumentError, match="does not fit"):
        calibrate_stream_order(model, length=LAYERS, prompts=prompts, save=False)
    with pytest.raises(InvalidArgumentError, match="distinct layers"):
        store_stream_order(model_identity(model), StreamOrder((1, 1), (0.5, 0.4), {}))


@pytest.mark.parametrize("family", ["llama", "qwen2-swa"])
def test_skip_drafts_from_the_resident_layers_while_the_order_streams(family):
    model = damped(family)
    chosen = token_prompts(2, 12, seed=7)
    expected = [hf_greedy(model, prompt, NEW_TOKENS) for prompt in chosen]
    order = calibrate_stream_order(model, length=4, prompts=token_prompts(), tokens=8, width=4)
    needs = memory_needs(model.config, torch.float64, "dytc", context_tokens=64, prefetch=1)
    plan = offload(model, LAYERS - 3, needs)
    assert plan.streamed == order.skipped(3) and plan.needs.stream_order == order.layers
    assert all(p.is_meta for i in plan.streamed for p in model.layers[i].parameters())
    skip, agreement = streamed_skip(model)
    assert skip == skip_layers(plan.streamed) and agreement == order.agreement_at(3)
    dytc = make_drafter("dytc", model)
    [option] = [o for o in dytc.options.values() if isinstance(o.drafter, LayerSkipDrafter)]
    assert option.drafter.skip == skip and option.prior_acceptance == agreement
    layer_skip = make_drafter("layer-skip", model, DraftConfig(num_draft_tokens=3))
    # dytc as it chooses (by the clock: any mix of its drafters), then held to its skip option, which must accept
    skipping = make_drafter("dytc", model)
    skipping.plan = lambda max_tokens, *args, **kwargs: (option.key, min(3, max_tokens), 0)
    for method, drafter in (("dytc", dytc), ("dytc", skipping), ("layer-skip", layer_skip)):
        accepted = 0
        for prompt, reference in zip(chosen, expected):
            result = Generator(model, drafter, method=method).generate(
                prompt, GenerationConfig(max_new_tokens=NEW_TOKENS))
            assert result.token_ids == reference, f"{family} {method}"
            counts = result.stats.offload
            # one sweep of the streamed layers per verification pass: no draft token read one
            assert counts["acquires"] == result.stats.target_forwards * 3 and counts["out_of_order"] == 0, method
            assert counts["streamed_layers"] == list(plan.streamed)
            accepted += result.stats.accepted_draft_tokens
        assert accepted > 0 or drafter is dytc, method
    chosen_keys = {key for key, count in skipping.counters()["choices"].items() if count}
    assert chosen_keys == {option.key}, skipping.counters()["choices"]
    with pytest.raises(InvalidArgumentError, match="drop --sparsity"):
        make_drafter("layer-skip", model, DraftConfig(sparsity=0.4))
    model.close()


def test_without_an_order_the_deepest_layers_stream_and_layer_skip_says_what_to_do():
    model = damped("llama")
    plan = offload(model, LAYERS - 3, memory_needs(model.config, torch.float64, "layer-skip", context_tokens=64,
                                                   prefetch=1))
    assert plan.streamed == (5, 6, 7) and streamed_skip(model) is None
    with pytest.raises(InvalidArgumentError, match="cats calibrate MODEL --stream-order"):
        make_drafter("layer-skip", model)
    dytc = make_drafter("dytc", model)  # lookup and recycling only
    assert not any(isinstance(o.drafter, LayerSkipDrafter) for o in dytc.options.values())
    model.close()


def test_an_order_naming_a_layer_the_method_keeps_resident_is_not_used():
    model = damped("llama", layers=(1, 2))
    order = calibrate_stream_order(model, length=3, prompts=token_prompts(), tokens=8, width=4)
    assert 1 in order.layers[:2]
    needs = memory_needs(model.config, torch.float64, "dytc", context_tokens=64, prefetch=1)
    needs.min_resident_layers = 2  # as a draft adapter at layer 1 would ask
    plan = offload(model, LAYERS - 3, needs)
    assert plan.streamed == (5, 6, 7) and streamed_skip(model) is None
    model.close()


@needs(STORIES_HF)
def test_calibrate_command_stream_order(capsys, monkeypatch):
    from cats.cli import main

    monkeypatch.delenv("CATS_CACHE")  # the default cache: its compiled kernels (a private one compiles them, ~35 s)
    argv = ["calibrate", "--model", str(STORIES_HF), "--stream-order", "--length", "2", "--width", "2",
            "--num-prompts", "2", "--tokens", "8", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "stream order of 2 of 5 layers" in out and " 2 streamed: layers [" in out and "skip-draft agreement" in out
    path = Path(out.strip().splitlines()[-1].removeprefix("cached in "))
    try:
        assert len(json.loads(path.read_text())["order"]["layers"]) == 2
    finally:
        path.unlink()  # nothing of the test's left in the user's cache
    assert main(argv + ["--sparsity", "0.4"]) == 2
    assert "apply to skip sets, not to --stream-order" in capsys.readouterr().err
    assert main(["calibrate", "--model", str(STORIES_HF), "--length", "2"]) == 2


@pytest.mark.parametrize("path", sorted(SHIPPED.glob("*.json")), ids=lambda p: p.stem)
def test_each_shipped_stream_order_is_found_by_its_models_fingerprint_and_reads(path):
    data = json.loads(path.read_text())
    assert data["model"]["fingerprint"] == path.stem
    order = StreamOrder.from_dict(data["order"])
    order.validate(data["model"]["num_layers"])
    assert 0 not in order.layers and all(0.0 < a <= 1.0 for a in order.agreement)


def test_a_shipped_order_is_read_without_a_checksum(monkeypatch, tmp_path):
    model = damped("llama")
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr("cats.model.weights.stream_order.SHIPPED", shipped)
    fingerprint = model_fingerprint(model)
    order = StreamOrder((5, 6), (0.9, 0.8), {"tokens": 8})
    (shipped / f"{fingerprint}.json").write_text(json.dumps(
        {"format": "cats-stream-order/1", "model": model_identity(model), "order": order.to_dict()}))
    assert load_stream_order(fingerprint, LAYERS) == order
    store_stream_order(model_identity(model), StreamOrder((6,), (0.95,), {}))
    assert load_stream_order(fingerprint, LAYERS).layers == (6,)  # the cache's own comes first
