"""The compiled (inductor) layer parts: same tokens as eager on every path, and a clean fallback to eager."""

from __future__ import annotations

import pytest
import torch

from cats.draft import EarlyExitDrafter, PromptLookupDrafter
from cats.generate import GenerationConfig, Generator
from cats.model import lean
from tests.conftest import VOCAB, hf_greedy, tiny_model

PROMPT = torch.randint(3, VOCAB, (8,), generator=torch.Generator().manual_seed(11)).tolist() * 2


def tokens(model, drafter=None, new=24):
    return Generator(model, drafter).generate(PROMPT, GenerationConfig(max_new_tokens=new)).token_ids


@pytest.fixture(scope="module")
def compiled_llama():
    model = tiny_model("llama", seed=4, damp=0.1)
    reference = hf_greedy(model, PROMPT, 24)
    outcome = lean.compile_layers(model)
    yield model, reference, outcome
    lean.uncompile_layers(model)


def test_compiled_parts_keep_every_method_lossless(compiled_llama):
    model, reference, outcome = compiled_llama
    if not outcome["compiled"]:
        pytest.skip(outcome["reason"])
    names = [name for name, _ in model.hf_model.named_parameters()]
    assert all(".module." not in name for name in names)  # parameter names unchanged (streaming relies on them)
    assert model.layers[0].mlp.forward.__func__ is lean._lean_forward
    plain = tokens(model)
    assert plain == reference  # greedy tokens are the eager model's
    for drafter in (PromptLookupDrafter(num_tokens=4), EarlyExitDrafter(model, layer=1, num_tokens=3)):
        assert tokens(model, drafter) == plain
    assert not outcome["state"].get("failed"), outcome["state"]


def test_compile_failure_falls_back_to_eager(monkeypatch):
    model = tiny_model("qwen2", seed=2)
    eager = tokens(model, new=8)
    lean.compile_layers(model)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler\nmore detail")

    for layer in model.layers:
        for part in lean.COMPILED_PARTS:
            getattr(layer, part)._lean["compiled"] = broken
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        fallen_back = tokens(model, new=8)
    assert fallen_back == eager
    assert model._lean_state["failed"] == "RuntimeError: no C++ compiler"
    lean.uncompile_layers(model)
    assert "forward" not in vars(model.layers[0].mlp)


def test_compile_can_be_refused(monkeypatch):
    monkeypatch.setenv("CATS_NO_COMPILE", "1")
    model = tiny_model("llama", seed=1)
    with pytest.warns(RuntimeWarning, match="CATS_NO_COMPILE"):
        outcome = lean.compile_layers(model)
    assert outcome == {"compiled": False, "reason": "CATS_NO_COMPILE is set", "state": {}}
    assert "forward" not in vars(model.layers[0].mlp)


@torch.no_grad()
def test_packed_bf16_linears_give_the_same_tokens_and_logits():
    model = tiny_model("llama", seed=5, damp=0.1, dtype=torch.bfloat16)
    ids = torch.tensor(PROMPT)
    eager_logits = model.forward(ids, model.new_cache())
    eager = tokens(model, new=16)
    outcome = lean.pack_linears(model)
    if outcome["reason"]:
        pytest.skip(outcome["reason"])
    assert outcome["packed"] == 7 * model.num_layers  # q, k, v, o, gate, up, down
    assert torch.equal(model.forward(ids, model.new_cache()), eager_logits)
    assert tokens(model, new=16) == eager
    assert tokens(model, PromptLookupDrafter(num_tokens=4), new=16) == eager
    with torch.no_grad():  # a changed weight is packed again
        model.layers[0].mlp.down_proj.weight.mul_(0.5)
    assert not torch.equal(model.forward(ids, model.new_cache()), eager_logits)
    lean.unpack_linears(model)
    assert "forward" not in vars(model.layers[0].mlp.down_proj)


def test_packing_is_for_bf16_only():
    model = tiny_model("llama", seed=5)
    assert lean.pack_linears(model) == {"packed": 0, "reason": "prepacking is for bfloat16 weights, not torch.float64"}
