"""Streaming under a memory budget: every method stays lossless with most layers streamed (tiny float64 models,
against transformers' greedy decoding), the reader reads layers in the order passes use them, the counters add up,
the streamed parameters are not kept between uses, and the page cache does not keep the store."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

import cats
from cats.methods import CONFIDENCE_STOP, make_drafter, memory_needs
from cats.model.adapter import new_adapter
from cats.draft import EarlyExitDrafter
from cats.draft.sizing import BUCKETS
from cats.errors import InvalidArgumentError
from cats.config import GenerationConfig
from cats.loop.generator import Generator
from cats.model.weights import MemoryNeeds, offload_model, plan_for
from cats.model.weights.rss import page_cache_bytes, peak_rss_bytes, reset_peak_rss
from cats.model.weights.stream import LayerStreamer
from cats.model import LayeredModel
from tests.conftest import VOCAB, hf_greedy, tiny_config
from cats.config import DraftConfig
from cats.config import MemoryConfig, KernelConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
LAYERS = 8
NEW_TOKENS = 24


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CATS_CACHE", str(tmp_path / "cache"))


def deep_model(family: str, seed: int = 0) -> LayeredModel:
    """An 8-layer tiny model whose shallow exits often agree with the full model (so drafts are accepted)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family)
    config.num_hidden_layers = LAYERS
    if getattr(config, "layer_types", None):
        config.layer_types = (config.layer_types * LAYERS)[:LAYERS]
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="sdpa")
    with torch.no_grad():
        for layer in hf_model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    return LayeredModel(hf_model.eval(), tokenizer=None, name=f"deep-{family}")


def offload(model, resident: int, needs: MemoryNeeds, io: str = "direct"):
    budget = plan_for(model.hf_model, 1 << 40, needs).with_resident(resident).planned_bytes
    plan = offload_model(model, budget, needs, io=io)
    assert plan.resident_layers == resident and len(plan.streamed) == LAYERS - resident
    return plan


def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (12,), generator=g).tolist(), torch.randint(3, VOCAB, (6,), generator=g).tolist() * 3]


@pytest.mark.parametrize("family, prompt_indices", [("llama", (0, 1)), ("qwen2-swa", (1,)), ("gemma3", (1,))])
def test_every_method_is_lossless_while_streaming(family, prompt_indices, tmp_path):
    from cats.methods import make_scorer

    model = deep_model(family)
    chosen = [prompts()[i] for i in prompt_indices]
    expected = [hf_greedy(model, prompt, NEW_TOKENS) for prompt in chosen]
    adapters = tmp_path / "adapters"
    new_adapter(model, "draft", 1).save(adapters / "draft")
    new_adapter(model, "shallow", 2).save(adapters / "shallow")
    deep_shallow = tmp_path / "deep-shallow"
    shutil.copytree(adapters / "draft", deep_shallow / "draft")
    new_adapter(model, "shallow", 4).save(deep_shallow / "shallow")
    assert offload(model, 2, MemoryNeeds(context_tokens=64, min_resident_layers=2, max_tree_tokens=33,
                                         prefetch=1)).pool_slots == 2
    assert all(p.device.type == "meta" for layer in model.layers[2:] for p in layer.parameters())
    methods = [("ar", {}), ("pld", {"num_draft_tokens": 4}), ("early-exit", {"draft_layer": 1, "num_draft_tokens": 3}),
               ("tree", {"draft_layer": 1, "total_tokens": 12}), ("cats", {"adapters": str(adapters), "total_tokens": 8}),
               ("dytc", {})]  # dytc without layer skipping while layers stream: lookup and recycling trees
    for method, options in methods:
        drafter = make_drafter(method, model, DraftConfig(**options))
        scorer = make_scorer(method, model, drafter, DraftConfig(adapters=options.get("adapters")))
        for prompt, reference in zip(chosen, expected):
            result = Generator(model, drafter, method=method, scorer=scorer).generate(
                prompt, GenerationConfig(max_new_tokens=NEW_TOKENS))
            assert result.token_ids == reference, f"{family} {method}"
            counts = result.stats.offload
            assert counts["acquires"] == result.stats.target_forwards * (LAYERS - 2), method  # one sweep per pass
            assert counts["out_of_order"] == 0 and counts["streamed_layers"] == list(range(2, LAYERS))
            assert counts["layers_read"] >= counts["acquires"] - 2  # at most the pool was read before it began
    assert all(p.device.type == "meta" for layer in model.layers[2:] for p in layer.parameters()), "dropped again"
    # a shallow verifier above the resident layers: [2, 4) stream in the same sweep, the cascade only prunes
    drafter = make_drafter("cats", model, DraftConfig(adapters=str(deep_shallow), total_tokens=8))
    scorer = make_scorer("cats", model, drafter, DraftConfig(adapters=str(deep_shallow)))
    assert scorer.corrections is False
    for prompt, reference in zip(chosen, expected):
        result = Generator(model, drafter, method="cats", scorer=scorer).generate(
            prompt, GenerationConfig(max_new_tokens=NEW_TOKENS))
        assert result.token_ids == reference, f"{family} cats with streamed shallow layers"
        assert result.stats.offload["out_of_order"] == 0  # one sweep per pass
    model.close()


def test_drafts_are_accepted_while_streaming():
    """The lossless test above must cover acceptance, not just rejection: one pass verifies several tokens."""
    model = deep_model("llama")
    offload(model, 1, MemoryNeeds(context_tokens=64, min_resident_layers=1, max_tree_tokens=17, prefetch=1))
    result = Generator(model, make_drafter("tree", model, DraftConfig(draft_layer=1))).generate(
        prompts()[1], GenerationConfig(max_new_tokens=NEW_TOKENS))
    assert result.stats.mean_accepted > 1.5
    assert result.stats.offload["acquires"] == result.stats.target_forwards * (LAYERS - 1)
    model.close()


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_reader_follows_the_access_order_and_counters_add_up(io, monkeypatch):
    order: list[int] = []
    read = LayerStreamer._read

    def recording_read(self, layer, slot):
        order.append(layer)
        return read(self, layer, slot)

    monkeypatch.setattr(LayerStreamer, "_read", recording_read)
    model = deep_model("llama")
    expected = hf_greedy(model, prompts()[0], NEW_TOKENS)
    plan = offload(model, 3, MemoryNeeds(context_tokens=64, prefetch=2), io=io)
    result = Generator(model).generate(prompts()[0], GenerationConfig(max_new_tokens=NEW_TOKENS))
    assert result.token_ids == expected
    model.close()  # waits for the read in flight, so that the counters and the recorded order agree
    counters = model.weights.snapshot()
    streamed = list(range(3, LAYERS))
    assert counters.acquires == result.stats.target_forwards * len(streamed)  # prefill + one pass per token (ar)
    assert len(order) == counters.layers_read >= counters.acquires
    assert order == (streamed * (len(order) // len(streamed) + 1))[: len(order)], "reads follow the access order"
    assert counters.layers_read - counters.acquires <= plan.pool_slots  # read ahead by at most the pool
    layer_bytes = model.weights.headers[3].data_bytes
    assert counters.bytes_read == counters.layers_read * layer_bytes
    assert 0.0 <= counters.hidden_fraction <= 1.0 and counters.read_s > 0
    assert counters.stall_s <= result.stats.wall_s and counters.stalls <= counters.acquires
    stats = result.stats.offload
    assert stats["io"] == io and 0 <= stats["hidden_fraction"] <= 1
    # every read was dropped from the page cache (direct: never in it): the streamed files are not kept there. A
    # few pages may linger a moment (3 pages of one file in 1 of 4 full-suite runs); one kept layer is ~60 pages
    assert page_cache_bytes(model.weights.store_files()) < layer_bytes // 4


def test_out_of_order_use_is_still_correct():
    model = deep_model("llama")
    reference = model.hf_model.model.layers
    hidden = torch.randn(1, 5, 64, dtype=torch.float64)
    cache = model.new_cache()
    expected = model.forward_layers(hidden, 0, LAYERS, cache)
    offload(model, 2, MemoryNeeds(context_tokens=64, prefetch=1))
    assert reference[5].mlp.up_proj.weight.device.type == "meta"
    for stop in (5, 3, 8, 6):  # a pass abandoned at layer `stop`: the next pass starts out of access order
        model.forward_layers(hidden, 0, stop, model.new_cache())
        assert torch.equal(model.forward_layers(hidden, 0, LAYERS, model.new_cache()), expected)
    assert model.weights.snapshot().out_of_order == 3
    model.close()


def test_drafter_needs_resident_draft_layers():
    model = deep_model("llama")
    offload(model, 1, MemoryNeeds(context_tokens=64, min_resident_layers=1, max_tree_tokens=9, prefetch=1))
    with pytest.raises(InvalidArgumentError, match=r"runs layers \[0, 3\) every draft step.*only \[0, 1\) resident"):
        make_drafter("early-exit", model, DraftConfig(draft_layer=3))
    make_drafter("early-exit", model, DraftConfig(draft_layer=1))
    model.close()


def test_planned_context_is_enforced():
    model = deep_model("llama")
    offload(model, 1, MemoryNeeds(context_tokens=20, prefetch=1))
    with pytest.raises(InvalidArgumentError, match="reserved KV cache for 20 tokens"):
        Generator(model).generate(prompts()[0], GenerationConfig(max_new_tokens=10))
    model.close()


def test_speculation_bucket_is_chosen_once_from_the_measured_io():
    from cats.draft.sizing import BUCKETS

    model = deep_model("llama")
    offload(model, 1, MemoryNeeds(context_tokens=64, min_resident_layers=1, max_tree_tokens=65, prefetch=1))
    drafter = make_drafter("tree", model, DraftConfig(draft_layer=1))
    bucket, info = model._speculation[False]
    assert bucket in BUCKETS and (drafter.total_tokens, drafter.depth, drafter.tree_topk) == (
        bucket.total_tokens, bucket.depth, bucket.tree_topk)
    assert info["io_s_per_pass"] > 0 and set(info["pass_s"]) == {"1"} | {str(b.tree_pass_tokens) for b in BUCKETS}
    assert make_drafter("tree", model, DraftConfig(draft_layer=1, total_tokens=5)).total_tokens == 5  # explicit wins
    assert isinstance(make_drafter("early-exit", model, DraftConfig(draft_layer=1)), EarlyExitDrafter)
    # the bucket caps the drafts; the confidence stop still applies (default) unless turned off
    assert drafter.threshold == CONFIDENCE_STOP and make_drafter("tree", model, DraftConfig(draft_layer=1, threshold=0.0)).threshold == 0
    model.close()


def test_peak_rss_helpers():
    assert reset_peak_rss()
    before = peak_rss_bytes()
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    assert peak_rss_bytes() >= before + (60 << 20)
    del block


STORIES = __import__("pathlib").Path(__file__).resolve().parents[1].parent / "shared" / "data" / "stories260k-gguf" / "hf"


@pytest.mark.skipif(not STORIES.is_dir(), reason="../shared/data is not available")
def test_cli_prints_the_plan_and_streaming_stats(capsys, monkeypatch):
    """The command line's budget is the process's: the runtime measured before loading (here a fixed 300 MiB, the
    test process holding more than a user's would) is planned for, then the model's part."""

    import cats.api
    from cats.cli import main

    monkeypatch.setattr(cats.api, "anonymous_rss_bytes", lambda: 300 << 20)

    args = ["generate", "--model", str(STORIES), "--prompt", "Once upon a time", "--max-new-tokens", "12",
            "--method", "early-exit", "--draft-layer", "1", "-k", "2", "--json", "--stats"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(args + ["--memory-budget", "95%+332MiB", "--prefetch", "1", "--offload-io", "buffered"]) == 0
    captured = capsys.readouterr()
    budgeted = json.loads(captured.out.strip().splitlines()[-1])
    assert budgeted["token_ids"] == plain["token_ids"]
    streamed = budgeted["stats"]["offload"]["streamed_layers"]
    first = streamed[0]
    assert 1 <= first < 5 and streamed == list(range(first, 5))  # draft layer resident, deeper ones streamed
    assert "memory plan: budget" in captured.err and f"streamed layers [{first}, 5)" in captured.err
    assert re.search(r"runtime \(measured before loading weights\) +300\.0 MiB", captured.err)
    assert re.search(r"library pages read each step +32\.0 MiB", captured.err)
    assert f"offload: layers [{first}, 5) streamed (buffered)" in captured.err and "peak RSS" in captured.err
    assert budgeted["stats"]["offload"]["acquires"] == (5 - first) * budgeted["stats"]["target_forwards"]
    assert main(args + ["--memory-budget", "1%+300MiB"]) == 2
    assert "below the minimum of" in capsys.readouterr().err
    assert main(args + ["--prefetch", "1"]) == 2
    assert "--prefetch applies with --memory-budget only" in capsys.readouterr().err
    # the KV cache is planned for the context window at most: a generation ends there whatever --max-new-tokens says
    assert main(args + ["--memory-budget", "95%+332MiB", "--max-context", "2049"]) == 2
    assert "longer than the model's context window of 2048 tokens" in capsys.readouterr().err
    long = [a if a != "12" else "100000" for a in args]
    assert main(long + ["--memory-budget", "95%+340MiB", "--stop", "."]) == 0
    assert "KV cache (2048 + 3 tokens)" in capsys.readouterr().err


def test_generate_api_under_a_budget(tmp_path):
    model = deep_model("llama")
    folder = tmp_path / "model"
    model.hf_model.save_pretrained(folder)
    prompt = prompts()[1]
    expected = hf_greedy(model, prompt, 12)
    smallest = DraftConfig(draft_layer=1, total_tokens=BUCKETS[0].total_tokens)  # the tree the budget then reserves
    needs = memory_needs(model.config, torch.float64, "tree", smallest, context_tokens=len(prompt) + 12,
                         prompt_tokens=len(prompt), prefetch=1)  # (the read-ahead the plan then takes)
    budget = plan_for(model.hf_model, 1 << 40, needs).with_resident(2).planned_bytes
    result = cats.generate(str(folder), prompt, method="tree", generation=GenerationConfig(max_new_tokens=12), drafting=DraftConfig(draft_layer=1), memory=MemoryConfig(budget=budget), kernels=KernelConfig(dtype="float64"))
    assert result.token_ids == expected
    assert result.stats.offload["streamed_layers"] == list(range(2, LAYERS)) and result.stats.peak_rss_mb > 0


def test_cascade_with_streamed_shallow_layers_verifies_the_bare_tree_it_planned(tmp_path):
    """`cats` with the draft size left to the budget, its shallow verifier above the resident layers: the plan
    reserves the bare tree's pass (no corrections while those layers stream), the cascade adds none, every pass fits
    what was planned, and the answer is plain greedy's."""
    model = deep_model("llama")
    folder, adapters = tmp_path / "model", tmp_path / "adapters"
    model.hf_model.save_pretrained(folder)
    new_adapter(model, "draft", 1).save(adapters / "draft")
    new_adapter(model, "shallow", 4).save(adapters / "shallow")
    prompt = prompts()[1]
    expected = hf_greedy(model, prompt, 12)
    bare = DraftConfig(adapters=str(adapters), total_tokens=BUCKETS[0].total_tokens // 2)  # 2 n + 1 = n_0 + 1 tokens
    needs = memory_needs(model.config, torch.float64, "cats", bare, context_tokens=len(prompt) + 12,
                         prompt_tokens=len(prompt), prefetch=1)
    budget = plan_for(model.hf_model, 1 << 40, needs).with_resident(2).planned_bytes
    loaded = cats.load(str(folder), kernels=KernelConfig(dtype="float64"), memory=MemoryConfig(budget=budget),
                       method="cats", drafting=DraftConfig(adapters=str(adapters)),
                       context_tokens=len(prompt) + 12)
    plan = loaded.memory_plan
    assert plan.resident_layers < 4 and plan.needs.max_tree_tokens in {b.total_tokens + 1 for b in BUCKETS}
    result = cats.generate(loaded, prompt, method="cats", generation=GenerationConfig(max_new_tokens=12),
                           drafting=DraftConfig(adapters=str(adapters)))
    assert result.token_ids == expected
    assert result.stats.shallow["nodes_corrected"] == 0 and result.stats.offload["out_of_order"] == 0
    assert result.stats.offload["streamed_layers"][0] == plan.resident_layers
    loaded.close()


def test_eagle_drafts_without_touching_streamed_layers():
    """Feature drafting runs no target layer: every pass streams the deep layers once, for several tokens."""
    from cats.draft.eagle import FeatureDrafter
    from tests.test_draft_feature import feature_adapter

    model = deep_model("llama")
    adapter = feature_adapter(model)  # before offloading: it copies layer 0
    expected = hf_greedy(model, prompts()[0], NEW_TOKENS)
    offload(model, 1, MemoryNeeds(context_tokens=64, min_resident_layers=0, max_tree_tokens=17, prefetch=1))
    result = Generator(model, FeatureDrafter(model, adapter)).generate(prompts()[0], GenerationConfig(max_new_tokens=NEW_TOKENS))
    assert result.token_ids == expected
    assert result.stats.accepted_draft_tokens > 0
    counts = result.stats.offload
    assert counts["acquires"] == result.stats.target_forwards * (LAYERS - 1) and counts["out_of_order"] == 0
    model.close()
