"""Adapters: save/load with identity checks, cache-vs-sequence consistency, and lossless drafting with them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from cats.draft import EarlyExitDrafter
from cats.model.adapter import AdapterError, find_adapter, load_adapter, new_adapter
from cats.config import GenerationConfig
from cats.loop.generator import Generator
from tests.conftest import FAMILIES, VOCAB, hf_greedy, tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", damp=0.1)


def test_save_load_roundtrip_and_identity_checks(llama, tmp_path):
    adapter = new_adapter(llama, "draft", 2, vocab_subset=list(range(40, 80)))
    with torch.no_grad():
        adapter.norm.weight.mul_(1.5)  # something that is not the target's own norm
    adapter.save(tmp_path / "draft")
    loaded = load_adapter(find_adapter(tmp_path, "draft"), llama, role="draft", layer=2)
    assert loaded.config.base_model["fingerprint"] == adapter.config.base_model["fingerprint"]
    assert loaded.config.vocab_subset == list(range(40, 80))
    hidden = torch.randn(1, 7, 64, dtype=torch.float64)
    assert torch.equal(loaded.logits(loaded(hidden, attention_mask=None)), adapter.logits(adapter(hidden, attention_mask=None)))
    assert set(dict(loaded.named_parameters())) == {n for n, _ in adapter.named_parameters()}  # no target weights
    # stored in bfloat16: half the bytes, loaded back into the model's dtype as the rounded weights
    adapter.save(tmp_path / "half", dtype=torch.bfloat16)
    stored = load_file(tmp_path / "half" / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    half = load_adapter(tmp_path / "half", llama)
    for name, weight in adapter.state_dict().items():
        assert half.state_dict()[name].dtype == torch.float64
        assert torch.equal(half.state_dict()[name], weight.to(torch.bfloat16).double())
    other = tiny_model("llama", seed=5)
    with pytest.raises(AdapterError, match=r"trained for model 'tiny-llama' \(fingerprint \w+\), not for 'tiny-llama' \(fingerprint"):
        load_adapter(tmp_path / "draft", other)
    with pytest.raises(AdapterError, match="is a draft adapter, not a shallow adapter"):
        load_adapter(tmp_path / "draft", llama, role="shallow")
    with pytest.raises(AdapterError, match="trained at layer 2, not at layer 3"):
        load_adapter(tmp_path / "draft", llama, layer=3)
    with pytest.raises(AdapterError, match="lacks config.json"):
        load_adapter(tmp_path / "nothing", llama)
    with pytest.raises(AdapterError, match="no shallow adapter"):
        find_adapter(tmp_path, "shallow")
    with pytest.raises(AdapterError, match="outside"):
        new_adapter(llama, "draft", 4)


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen2-swa"])
@torch.no_grad()
def test_cached_decoding_equals_whole_sequence(family):
    """The adapter's incremental (cached) path used when drafting equals the whole-sequence path used in training."""
    model = tiny_model(family)
    adapter = new_adapter(model, "draft", 1, block="attention" if family == "llama" else "decoder")
    hidden = torch.randn(1, 30, 64, dtype=torch.float64)
    steps = torch.arange(30)
    visible = steps[None, :] <= steps[:, None]
    if adapter.kind == "sliding_attention":
        visible &= steps[:, None] - steps[None, :] < model.sliding_window
    mask = torch.zeros(30, 30, dtype=torch.float64).masked_fill(~visible, torch.finfo(torch.float64).min)[None, None]
    whole = adapter(hidden, attention_mask=mask)
    cache = model.new_cache(extra_layers=1)
    parts = [adapter(hidden[:, :20], cache)] + [adapter(hidden[:, t : t + 1], cache) for t in range(20, 30)]
    assert torch.allclose(torch.cat(parts, 1), whole, atol=1e-10, rtol=0)
    assert cache.length(model.num_layers) == 30


@pytest.mark.parametrize("family", FAMILIES)
def test_drafting_with_adapter_is_lossless(family):
    model = tiny_model(family, damp=0.1)
    torch.manual_seed(0)
    full = new_adapter(model, "draft", 2)
    reduced = new_adapter(model, "draft", 1, vocab_subset=torch.randperm(VOCAB)[:48].tolist(), block="attention")
    prompt = torch.randint(3, VOCAB, (10,), generator=torch.Generator().manual_seed(1)).tolist() * 2
    expected = hf_greedy(model, prompt, 40)
    for adapter, k, threshold in ((full, 4, 0.0), (reduced, 3, 0.0), (full, 6, 0.3)):
        drafter = EarlyExitDrafter(model, num_tokens=k, adapter=adapter, threshold=threshold)
        generator = Generator(model, drafter)
        result = generator.generate(prompt, GenerationConfig(max_new_tokens=40))
        assert result.token_ids == expected, (family, drafter.describe())


def test_adapter_cache_stays_in_step_with_the_target(llama):
    """After every step the adapter's cache layer holds exactly the committed tokens, like every target layer."""
    adapter = new_adapter(llama, "draft", 1)
    drafter = EarlyExitDrafter(llama, num_tokens=4, adapter=adapter)
    generator = Generator(llama, drafter)
    stats = __import__("cats").GenerationStats()
    prompt = [5, 6, 7, 8, 9]
    seen = []
    stream = generator.stream(prompt, GenerationConfig(max_new_tokens=30, ignore_eos=True), stats)
    original = drafter.propose

    def checking_propose(state, max_tokens):
        seen.append(state.cache.lengths())
        assert state.cache.lengths() == [state.committed_length] * (llama.num_layers + 1)
        return original(state, max_tokens)

    drafter.propose = checking_propose
    list(stream)
    assert len(seen) == stats.decode_steps and stats.accepted_draft_tokens >= 0


def test_adapter_and_layer_must_agree(llama):
    adapter = new_adapter(llama, "draft", 2)
    with pytest.raises(Exception, match="trained at layer 2"):
        EarlyExitDrafter(llama, layer=1, adapter=adapter)
    with pytest.raises(Exception, match="threshold"):
        EarlyExitDrafter(llama, threshold=1.5)
