"""``cats train adapter``: training improves agreement, checkpoints resume, the result drafts losslessly."""

from __future__ import annotations

import json
import random

import pytest
import torch

from cats.draft import EarlyExitDrafter
from cats.model.adapter import load_adapter, new_adapter
from cats.errors import InvalidArgumentError
from cats.config import GenerationConfig
from cats.loop.generator import Generator
from cats.train.folder import DataMix, TrainingData
from cats.train.trainer import TrainConfig, chain_accept_lengths, evaluate, make_batches, soft_cross_entropy, train_adapter
from tests.conftest import STORIES_HF, needs, stories_for_training, stories_training_data

pytestmark = needs(STORIES_HF)


@pytest.fixture(scope="module")
def model():
    return stories_for_training()


@pytest.fixture(scope="module")
def data(model, tmp_path_factory):
    return stories_training_data(model, tmp_path_factory.mktemp("data"), [1, 2])


def test_hand_computed_metrics():
    assert chain_accept_lengths([True, True, False, True, True, True], 3) == [2, 1, 0, 3]
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    ids, probs = torch.tensor([[0, 1, -1]]), torch.tensor([[0.6, 0.2, 0.2]])
    expected = -(0.75 * torch.log(torch.tensor(0.5)) + 0.25 * torch.log(torch.tensor(0.25)))  # renormalised inside
    assert torch.allclose(soft_cross_entropy(logits, ids, probs), expected)


def test_batches_cover_every_sample_once(data):
    batches = make_batches(data, 100, random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(data.num_samples))
    assert all(sum(data.sample_length(i) for i in b[:-1]) < 100 for b in batches)


def test_a_data_mix_reads_each_folder_in_turn(model, data, tmp_path):
    mix = DataMix.open([data.path, data.path], model=model)
    n = data.num_samples
    assert mix.num_samples == 2 * n and mix.num_response_tokens == 2 * data.num_response_tokens
    assert mix.layers == data.layers and mix.sample_length(n + 3) == data.sample_length(3)
    assert torch.equal(mix.sample(n + 3)["input_ids"], data.sample(3)["input_ids"])
    assert torch.equal(mix.response_token_counts(model.vocab_size), 2 * data.response_token_counts(model.vocab_size))
    with pytest.raises(IndexError):
        mix.sample(2 * n)
    other = json.loads((data.path / "meta.json").read_text())
    other["model"]["fingerprint"] = "0" * 16
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "meta.json").write_text(json.dumps({**other, "shards": []}))
    with pytest.raises(InvalidArgumentError, match="different models"):
        DataMix([data, TrainingData.open(tmp_path / "other")])


def test_training_improves_agreement_and_saves_a_lossless_adapter(model, data, tmp_path, capsys):
    config = TrainConfig(role="draft", layer=1, out=tmp_path / "draft", epochs=30, lr=3e-3, batch_tokens=256,
                         warmup_steps=5, position_fraction=1.0, draft_vocab=200, progress=False, checkpoint_every=0)
    before = evaluate(new_adapter(model, "draft", 1, vocab_subset=None), data, 1, None, "cpu")
    out = train_adapter(model, data, config, eval_data=data)
    adapter = load_adapter(out, model, role="draft", layer=1)
    training = adapter.config.training
    assert len(adapter.config.vocab_subset) == 200
    assert training["steps"] > 0 and training["learning_curve"] and training["train_tokens"] > 0
    after = training["final_eval"]
    assert after["agreement"] > before["agreement"] + 0.1, (before, after)  # it learns (here: fits its data)
    assert after["expected_accepted_gamma6"] >= before["expected_accepted_gamma6"]
    card = (out / "README.md").read_text()
    assert "draft adapter, layer 1" in card and f"| {after['agreement']:.3f} |" in card
    assert (out / "learning_curve.png").stat().st_size > 0
    prompt = model.tokenizer("Once upon a time")["input_ids"]
    expected = Generator(model).generate(prompt, GenerationConfig(max_new_tokens=40)).token_ids
    drafter = EarlyExitDrafter(model, num_tokens=4, adapter=adapter, threshold=0.2)
    assert Generator(model, drafter).generate(prompt, GenerationConfig(max_new_tokens=40)).token_ids == expected


def test_checkpoints_resume(model, data, tmp_path, capsys):
    settings = dict(role="shallow", layer=2, out=tmp_path / "shallow", epochs=5, batch_tokens=256, progress=False,
                    checkpoint_every=2, block="attention")
    train_adapter(model, data, TrainConfig(**settings, max_steps=4))
    state = json.loads((tmp_path / "shallow" / "checkpoint" / "cats-state.json").read_text())
    assert state["step"] == 4
    train_adapter(model, data, TrainConfig(**settings, max_steps=6))
    assert "resuming from step 4" in capsys.readouterr().out
    assert load_adapter(tmp_path / "shallow", model).config.training["steps"] == 6
    with pytest.raises(InvalidArgumentError, match="other settings"):
        train_adapter(model, data, TrainConfig(**{**settings, "batch_tokens": 128}, max_steps=8))


def test_bf16_mixed_precision_trains_in_bfloat16_and_keeps_float32_weights(model, data, tmp_path):
    settings = dict(role="draft", layer=1, epochs=30, lr=3e-3, batch_tokens=256, warmup_steps=5, position_fraction=1.0,
                    draft_vocab=200, progress=False, checkpoint_every=0, max_steps=6)
    seen = []
    original = torch.nn.functional.linear

    def recording_linear(x, weight, bias=None):
        out = original(x, weight, bias)
        seen.append(out.dtype)
        return out

    plain = train_adapter(model, data, TrainConfig(**settings, out=tmp_path / "fp32"), eval_data=data)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "linear", recording_linear)
        mixed = train_adapter(model, data, TrainConfig(**settings, out=tmp_path / "bf16", mixed_precision="bf16"),
                              eval_data=data)
    assert torch.bfloat16 in seen  # the products ran in bfloat16 (the read-out included: it is most of them)
    plain_losses = load_adapter(plain, model).config.training
    mixed_adapter = load_adapter(mixed, model)
    assert all(p.dtype == torch.float32 for p in mixed_adapter.parameters())
    assert mixed_adapter.config.training["settings"]["mixed_precision"] == "bf16"
    first, last = plain_losses["final_eval"], mixed_adapter.config.training["final_eval"]
    assert abs(first["agreement"] - last["agreement"]) < 0.15, (first, last)  # the same training, to rounding
    with pytest.raises(InvalidArgumentError, match="--mixed-precision"):
        train_adapter(model, data, TrainConfig(**settings, out=tmp_path / "x", mixed_precision="fp16"))


def test_bad_training_input(model, data, tmp_path):
    with pytest.raises(InvalidArgumentError, match="not of layer 3"):
        train_adapter(model, data, TrainConfig(role="draft", layer=3, out=tmp_path / "x"))
    with pytest.raises(InvalidArgumentError, match=r"outside \[1, 5\)"):
        train_adapter(model, data, TrainConfig(role="draft", layer=7, out=tmp_path / "x"))
    with pytest.raises(InvalidArgumentError, match="draft-vocab"):
        train_adapter(model, data, TrainConfig(role="draft", layer=1, out=tmp_path / "x", draft_vocab=10**6))


def test_train_adapter_command_line(data, tmp_path):
    import subprocess

    out = tmp_path / "cli-adapter"
    proc = subprocess.run(["cats", "train", "adapter", "--model", str(STORIES_HF), "--data", str(data.path),
                           "--data", str(data.path), "--eval-data", str(data.path), "--role", "draft", "--layer", "2", "--out", str(out),
                           "--max-steps", "3", "--epochs", "5", "--draft-vocab", "128", "--threads", "1", "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote adapter {out}" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["role"] == "draft" and config["layer"] == 2 and len(config["vocab_subset"]) == 128
    assert config["training"]["steps"] == 3 and config["training"]["command"].startswith("cats train adapter")
    assert config["training"]["data_samples"] == 2 * data.num_samples  # both --data folders
    assert (out / "README.md").is_file()
    bad = subprocess.run(["cats", "train", "adapter", "--model", str(STORIES_HF), "--data", str(data.path), "--role",
                          "draft", "--layer", "4", "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "not of layer 4" in bad.stderr and "Traceback" not in bad.stderr


def test_feature_adapter_trains_on_final_features_and_drafts_losslessly(model, data, tmp_path):
    import shutil

    from cats.draft.eagle import FeatureDrafter
    from cats.train.data import make_features

    folder = shutil.copytree(data.path, tmp_path / "data")
    depth = model.num_layers
    config = TrainConfig(role="draft", layer=depth, input="features", out=tmp_path / "feature", epochs=30, lr=3e-3,
                         batch_tokens=256, warmup_steps=5, position_fraction=1.0, draft_vocab=200, progress=False,
                         checkpoint_every=0)
    with pytest.raises(InvalidArgumentError, match="cats train features"):
        train_adapter(model, TrainingData.open(folder, model=model), config)
    assert make_features(model, folder, progress=False) == len(data.shards)
    assert make_features(model, folder, progress=False) == 0  # every shard has its file: nothing to redo
    fresh = TrainingData.open(folder, model=model)
    sample = fresh.sample(0, layers=[], features=True)
    with torch.no_grad():
        final = model.forward_layers(model.embed(sample["input_ids"]), 0, depth, model.new_cache())
        expected_features = model.decoder.norm(final)[0]
    assert torch.allclose(sample["features"].float(), expected_features, atol=0.05, rtol=0.02)  # stored in bf16
    with pytest.raises(InvalidArgumentError, match=f"--layer {depth}"):
        train_adapter(model, fresh, TrainConfig(role="draft", layer=2, input="features", out=tmp_path / "x"))
    before = evaluate(new_adapter(model, "draft", depth, input="features"), fresh, depth, None, "cpu")
    out = train_adapter(model, fresh, config, eval_data=fresh)
    adapter = load_adapter(out, model, role="draft", layer=depth)
    after = adapter.config.training["final_eval"]
    assert adapter.config.input == "features" and len(adapter.config.vocab_subset) == 200
    assert after["agreement"] > before["agreement"] + 0.1, (before, after)
    prompt = model.tokenizer("Once upon a time")["input_ids"]
    expected = Generator(model).generate(prompt, GenerationConfig(max_new_tokens=40)).token_ids
    result = Generator(model, FeatureDrafter(model, adapter)).generate(prompt, GenerationConfig(max_new_tokens=40))
    assert result.token_ids == expected
    assert result.stats.accepted_draft_tokens > 0


def test_early_exit_feature_adapter_trains_on_layer_states_and_features(model, data, tmp_path):
    """``--input features+hidden``: the next token's layer-L state in place of its embedding; the result drafts
    losslessly through early exit and accepts drafts."""
    import shutil

    from cats.train.data import make_features

    folder = shutil.copytree(data.path, tmp_path / "data")
    make_features(model, folder, progress=False)
    fresh = TrainingData.open(folder, model=model)
    config = TrainConfig(role="draft", layer=2, input="features+hidden", out=tmp_path / "early-exit", epochs=30,
                         lr=3e-3, batch_tokens=256, warmup_steps=5, position_fraction=1.0, draft_vocab=200,
                         progress=False, checkpoint_every=0)
    with pytest.raises(InvalidArgumentError, match="not of layer 3"):
        train_adapter(model, fresh, TrainConfig(role="draft", layer=3, input="features+hidden", out=tmp_path / "x"))
    with pytest.raises(InvalidArgumentError, match="--role draft"):
        train_adapter(model, fresh, TrainConfig(role="shallow", layer=2, input="features+hidden", out=tmp_path / "x"))
    before = evaluate(new_adapter(model, "draft", 2, input="features+hidden"), fresh, 2, None, "cpu")
    out = train_adapter(model, fresh, config, eval_data=fresh)
    adapter = load_adapter(out, model, role="draft", layer=2)
    after = adapter.config.training["final_eval"]
    assert adapter.config.input == "features+hidden" and after["agreement"] > before["agreement"] + 0.1, (before, after)
    assert "state after layer 2" in (out / "README.md").read_text()
    prompt = model.tokenizer("Once upon a time")["input_ids"]
    expected = Generator(model).generate(prompt, GenerationConfig(max_new_tokens=40)).token_ids
    result = Generator(model, EarlyExitDrafter(model, adapter=adapter, num_tokens=3)).generate(
        prompt, GenerationConfig(max_new_tokens=40))
    assert result.token_ids == expected
    assert result.stats.accepted_draft_tokens > 0
