"""The EAGLE-3 head (method ``eagle3``): its cache equals its full forward, it trains on the data's aux-layer states
and learns, it drafts losslessly (chains, trees, sampling, inside dytc), and bad heads and settings are refused."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch
from safetensors import safe_open

from cats.config import DraftConfig, GenerationConfig
from cats.draft.eagle import FeatureDrafter
from cats.errors import InvalidArgumentError
from cats.loop.generator import Generator
from cats.methods import make_drafter, memory_needs
from cats.model.adapter import new_adapter
from cats.model.eagle3 import Eagle3Error, load_eagle3_head, new_eagle3_head
from cats.train.trainer import TrainConfig, evaluate, train_adapter
from tests.conftest import STORIES_HF, VOCAB, hf_greedy, needs, stories_for_training, stories_training_data, tiny_model

AUX = [1, 2, 3]
SHAPES = [dict(tree_topk=1, total_tokens=5, depth=5), dict(tree_topk=4, total_tokens=16, depth=5)]


def causal_mask(length: int, dtype) -> torch.Tensor:
    hidden = ~torch.ones(length, length, dtype=torch.bool).tril()
    return torch.zeros(1, 1, length, length, dtype=dtype).masked_fill_(hidden, torch.finfo(dtype).min)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_the_cache_gives_the_full_forward_and_tiny_heads_draft_losslessly(family):
    model = tiny_model(family, damp=0.1)
    head = new_eagle3_head(model, AUX, heads=2, kv_heads=1, intermediate_size=32).eval().requires_grad_(False)
    with torch.no_grad():  # a head that does something: random weights everywhere
        for parameter in head.parameters():
            parameter.normal_(0, 0.3)
    size = model.config.hidden_size
    inputs = torch.randn(1, 9, 4 * size, dtype=model.dtype, generator=torch.Generator().manual_seed(0))
    full = head(inputs, attention_mask=causal_mask(9, model.dtype))  # training's form: fc inside
    fused = torch.cat([head.fc(inputs[..., : 3 * size]), inputs[..., 3 * size :]], dim=-1)
    cache = model.new_cache(extra_layers=1)
    pieces = torch.cat([head(fused[:, :5], cache), head(fused[:, 5:6], cache), head(fused[:, 6:], cache)], dim=1)
    assert torch.allclose(pieces, full, atol=1e-10)
    assert cache.length(model.num_layers) == 9
    prompt = torch.randint(3, VOCAB, (8,), generator=torch.Generator().manual_seed(1)).tolist() * 2
    expected = hf_greedy(model, prompt, 30)
    for shape in SHAPES:
        result = Generator(model, FeatureDrafter(model, head, **shape)).generate(prompt, GenerationConfig(max_new_tokens=30))
        assert result.token_ids == expected, shape


def test_the_training_time_test_is_what_drafting_computes():
    """`unrolled`'s second step at t equals a draft node at position t + 1 fed the first step's output at t, over a
    cache of the true entries 0..t (what `FeatureDrafter` does at depth 2)."""
    model = tiny_model("llama")
    head = new_eagle3_head(model, AUX, heads=4, kv_heads=2, intermediate_size=32).eval().requires_grad_(False)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0, 0.3)
    size, length = model.config.hidden_size, 7
    inputs = torch.randn(1, length, 4 * size, dtype=model.dtype, generator=torch.Generator().manual_seed(2))
    first, second = head(inputs, attention_mask=causal_mask(length, model.dtype), unroll=True)
    assert torch.allclose(first, head(inputs, attention_mask=causal_mask(length, model.dtype)))
    fused = torch.cat([head.fc(inputs[..., : 3 * size]), inputs[..., 3 * size :]], dim=-1)
    for t in range(length - 1):
        cache = model.new_cache(extra_layers=1)
        out = head(fused[:, : t + 1], cache)
        node = torch.cat([out[:, t], inputs[:, t + 1, 3 * size :]], dim=-1)[None]
        attend = torch.ones(1, t + 2, dtype=torch.bool)
        drafted = head(node, cache, position_ids=torch.tensor([t + 1]), attend=attend)
        assert torch.allclose(drafted[0, 0], second[0, t], atol=1e-10), t


def test_head_files_and_errors(tmp_path):
    model = tiny_model("llama")
    head = new_eagle3_head(model, AUX, intermediate_size=16, vocab_subset=list(range(40)))
    assert head.vocab_ids.tolist() == list(range(40)) and head.feature_layers == tuple(AUX)
    folder = head.save(tmp_path / "heads" / "eagle3", dtype=torch.bfloat16)
    with safe_open(str(folder / "model.safetensors"), "pt") as stored:
        keys = set(stored.keys())
        assert stored.get_tensor("fc.weight").dtype == torch.bfloat16
    assert {"fc.weight", "norm.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"} <= keys
    loaded = load_eagle3_head(folder, model)
    assert loaded.config.aux_layers == AUX and loaded.config.vocab_subset == list(range(40))
    with pytest.raises(Eagle3Error, match="trained for model"):
        load_eagle3_head(folder, tiny_model("qwen2"))
    with pytest.raises(Eagle3Error, match="three increasing"):
        new_eagle3_head(model, [2, 1, 3])
    with pytest.raises(Eagle3Error, match=r"must lie in \[1, 4\)"):
        new_eagle3_head(model, [1, 2, 4])
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text(json.dumps({"format": "cats-eagle3/1", "aux_layers": "x"}))
    shutil.copy(folder / "model.safetensors", tmp_path / "broken")
    with pytest.raises(Eagle3Error, match="not a CATS EAGLE-3 config"):
        load_eagle3_head(tmp_path / "broken", model)
    drafter = make_drafter("eagle3", model, DraftConfig(adapters=str(tmp_path / "heads"), tree_topk=1, depth=3))
    assert isinstance(drafter, FeatureDrafter) and drafter.name == "eagle3" and drafter.feature_layers == tuple(AUX)
    with pytest.raises(InvalidArgumentError, match="needs --adapters"):
        make_drafter("eagle3", model, DraftConfig(adapters=str(tmp_path)))
    with pytest.raises(InvalidArgumentError, match="--depth"):
        make_drafter("eagle3", model, DraftConfig(adapters=str(tmp_path / "heads"), num_draft_tokens=3))
    needs_ = memory_needs(model.config, torch.float32, "eagle3", DraftConfig(adapters=str(tmp_path / "heads")))
    assert needs_.min_resident_layers == 0 and needs_.extra_cache_layers == 1
    stored_values = sum(p.numel() for p in head.parameters())
    assert needs_.adapter_bytes == stored_values * 4 and needs_.head_rows == 40


# ------------------------------------------------------------------------------------------------ trained on stories
@pytest.fixture(scope="module")
def stories():
    if not STORIES_HF.exists():
        pytest.skip(f"{STORIES_HF} not present (../shared data missing)")
    return stories_for_training()


@pytest.fixture(scope="module")
def aux_data(stories, tmp_path_factory):
    return stories_training_data(stories, tmp_path_factory.mktemp("eagle3-data"), AUX)


@needs(STORIES_HF)
def test_eagle3_trains_and_drafts_losslessly(stories, aux_data, tmp_path):
    model, depth = stories, stories.num_layers
    config = TrainConfig(role="draft", layer=depth, arch="eagle3", aux_layers=AUX, heads=4, kv_heads=2,
                         intermediate_size=64, out=tmp_path / "adapters" / "eagle3", epochs=30, lr=3e-3,
                         batch_tokens=256, warmup_steps=5, position_fraction=1.0, draft_vocab=200, progress=False,
                         checkpoint_every=0)
    before = evaluate(new_eagle3_head(model, AUX, heads=4, kv_heads=2, intermediate_size=64), aux_data, depth, None,
                      "cpu")
    out = train_adapter(model, aux_data, config, eval_data=aux_data)
    head = load_eagle3_head(out, model)
    after = head.config.training["final_eval"]
    assert after["agreement"] > before["agreement"] + 0.1, (before, after)  # it learns (here: fits its data)
    assert "EAGLE-3 draft head" in (out / "README.md").read_text()
    prompt = model.tokenizer("Once upon a time")["input_ids"]
    expected = Generator(model).generate(prompt, GenerationConfig(max_new_tokens=40)).token_ids
    for shape in SHAPES:
        result = Generator(model, FeatureDrafter(model, head, **shape)).generate(prompt, GenerationConfig(max_new_tokens=40))
        assert result.token_ids == expected, shape
        assert result.stats.accepted_draft_tokens > 0
    sampled = dict(max_new_tokens=30, temperature=0.8, seed=5, ignore_eos=True)
    drafter = make_drafter("eagle3", model, DraftConfig(adapters=str(tmp_path / "adapters"), depth=3))
    first = Generator(model, drafter).generate(prompt, GenerationConfig(**sampled))
    assert first.token_ids == Generator(model, drafter).generate(prompt, GenerationConfig(**sampled)).token_ids
    dytc = make_drafter("dytc", model, DraftConfig(adapters=str(tmp_path / "adapters")), progress=False)
    result = Generator(model, dytc).generate(prompt, GenerationConfig(max_new_tokens=40))
    assert result.token_ids == expected
    assert {"eagle3", "eagle3-chain"} <= set(result.stats.scheduler["choices"]) | set(dytc.options)

    # beside a feature adapter, dytc drafts with whichever records the higher held-out agreement
    feature = new_adapter(model, "draft", depth, input="features")
    for recorded, chosen in ((after["agreement"] + 0.05, "eagle"), (after["agreement"] - 0.05, "eagle3")):
        feature.config.training = {"final_eval": {"agreement": recorded}}
        feature.save(tmp_path / "adapters" / "feature")
        dytc = make_drafter("dytc", model, DraftConfig(adapters=str(tmp_path / "adapters")), progress=False)
        features = {name for name in dytc.options if name.startswith("eagle")}
        assert features == {chosen, f"{chosen}-chain"}, (recorded, features)


@needs(STORIES_HF)
def test_eagle3_settings_are_checked(stories, aux_data, tmp_path):
    with pytest.raises(InvalidArgumentError, match="not of"):
        train_adapter(stories, aux_data, TrainConfig(role="draft", layer=stories.num_layers, arch="eagle3",
                                                     aux_layers=[1, 2, 4], out=tmp_path / "x"))
    with pytest.raises(InvalidArgumentError, match="--heads is a setting of --arch eagle3"):
        train_adapter(stories, aux_data, TrainConfig(role="draft", layer=1, heads=2, out=tmp_path / "x"))
    base = ["cats", "train", "adapter", "--model", str(STORIES_HF), "--data", str(aux_data.path), "--out",
            str(tmp_path / "cli")]
    refused = subprocess.run(base + ["--arch", "eagle3", "--role", "draft"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--role is a setting of an adapter" in refused.stderr
    proc = subprocess.run(base + ["--arch", "eagle3", "--aux-layers", "1,2,3", "--heads", "2", "--kv-heads", "1",
                                  "--intermediate-size", "32", "--max-steps", "2", "--threads", "1", "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["format"] == "cats-eagle3/1" and config["aux_layers"] == AUX and config["num_attention_heads"] == 2
