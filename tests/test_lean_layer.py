"""The lean decoder-layer forward (`cats.model.kernels.layer_forward`): the module's own math, every family it claims, every
mask kind the decode loop uses; the modules' forward where it does not apply."""

from __future__ import annotations

import pytest
import torch

from cats.draft import EarlyExitDrafter, PromptLookupDrafter, TreeDrafter
from cats.config import GenerationConfig
from cats.loop.generator import Generator
from cats.model import LayeredModel
from cats.model.kernels import avx512
from cats.model.kernels import packing as lean
from cats.model.kernels.layer_forward import lean_default, lean_unsupported
from tests.conftest import FAMILIES, VOCAB, hf_greedy, tiny_config, tiny_model

PROMPT = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(5)).tolist() * 2
LEAN_FAMILIES = [family for family in FAMILIES if family != "gemma3"]


def _both_ways(model: LayeredModel, tokens: torch.Tensor, attend: torch.Tensor | None, positions=None):
    """Logits and per-layer K/V after the same forward over a 12-token prefix, module forward vs lean forward."""
    results = []
    for lean_on in (False, True):
        model.lean = lean_on
        cache = model.new_cache()
        model.forward(torch.tensor(PROMPT[:12]), cache)
        logits = model.forward(tokens, cache, position_ids=positions, attend=attend)
        results.append((logits, [(layer.keys.clone(), layer.values.clone()) for layer in cache.hf_cache.layers]))
    model.lean = True
    return results


@pytest.mark.parametrize("family", LEAN_FAMILIES)
def test_lean_forward_is_the_module_forward(family):
    model = tiny_model(family, seed=3)
    assert model.lean and all(model._lean_layers)
    tree = torch.tensor([[True] * 12 + [True, False, False, False],
                         [True] * 12 + [True, True, False, False],
                         [True] * 12 + [True, False, True, False],
                         [True] * 12 + [True, False, True, True]])
    cases = [(torch.tensor([7]), None, None),  # one query: the packed single-query attention
             (torch.tensor([7, 8, 9, 10]), None, None),  # a chain: causal mask
             (torch.tensor([7, 8, 9, 10]), tree, torch.tensor([12, 13, 13, 14]))]  # a tree mask, shared positions
    for tokens, attend, positions in cases:
        (module_logits, module_kv), (lean_logits, lean_kv) = _both_ways(model, tokens, attend, positions)
        torch.testing.assert_close(lean_logits, module_logits, rtol=1e-12, atol=1e-12)
        for (k0, v0), (k1, v1) in zip(module_kv, lean_kv):
            torch.testing.assert_close(k1, k0, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(v1, v0, rtol=1e-12, atol=1e-12)


def test_eager_attention_and_partial_rotary_follow_the_module():
    """Phi3 with half of each head rotated, under the eager attention implementation."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(4)
    config = tiny_config("phi3")
    config.partial_rotary_factor = 0.5
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="eager")
    model = LayeredModel(hf_model.eval(), name="tiny-phi3-partial")
    assert all(model._lean_layers)
    for tokens in (torch.tensor([5]), torch.tensor([5, 6, 7])):
        (module_logits, _), (lean_logits, _) = _both_ways(model, tokens, None)
        torch.testing.assert_close(lean_logits, module_logits, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "phi3", "mistral-swa"])
def test_every_method_on_the_lean_forward_is_transformers_greedy(family):
    model = tiny_model(family, seed=8, damp=0.1)
    reference = hf_greedy(model, PROMPT, 20)  # transformers' own generate: never the lean forward
    config = GenerationConfig(max_new_tokens=20)
    for drafter in (None, PromptLookupDrafter(num_tokens=4), EarlyExitDrafter(model, layer=1, num_tokens=3),
                    TreeDrafter(model, layer=1, tree_topk=2, total_tokens=6, depth=3)):
        assert Generator(model, drafter).generate(PROMPT, config).token_ids == reference


def test_gemma3_and_unknown_layers_run_their_module_forward():
    model = tiny_model("gemma3", seed=1)
    assert not any(model._lean_layers)
    assert "Gemma3DecoderLayer has no lean forward" == lean_unsupported(model.layers[0])
    assert Generator(model).generate(PROMPT, GenerationConfig(max_new_tokens=8)).token_ids == hf_greedy(model, PROMPT, 8)


def test_training_mode_and_other_attention_are_refused():
    model = tiny_model("llama", seed=1)
    layer = model.layers[0]
    layer.train()
    assert lean_unsupported(layer) == "training mode"
    layer.eval()
    layer.self_attn.config._attn_implementation = "flex_attention"
    try:
        assert lean_unsupported(layer) == "attention implementation 'flex_attention'"
    finally:
        layer.self_attn.config._attn_implementation = "sdpa"


def test_cats_lean_environment_switch(monkeypatch):
    monkeypatch.setenv("CATS_LEAN", "0")
    assert not lean_default() and not tiny_model("llama").lean
    monkeypatch.setenv("CATS_LEAN", "1")
    model = tiny_model("llama")
    assert lean_default() and model.lean and not model.exact_attention
    monkeypatch.setenv("CATS_LEAN", "exact")
    model = tiny_model("llama")
    assert model.lean and model.exact_attention


def test_exact_attention_is_the_module_forward_bit_for_bit():
    """With exact_attention the single-query step calls transformers' own attention: bit-identical logits."""
    model = tiny_model("qwen2", seed=6)
    model.exact_attention = True
    (module_logits, module_kv), (lean_logits, lean_kv) = _both_ways(model, torch.tensor([7]), None)
    assert torch.equal(lean_logits, module_logits)
    assert all(torch.equal(k0, k1) and torch.equal(v0, v1) for (k0, v0), (k1, v1) in zip(module_kv, lean_kv))


@torch.no_grad()
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q, k and v carry biases
def test_fused_packed_projections_equal_the_separate_ones(family):
    """With packed bf16 weights q/k/v and gate/up run as one GEMM each: same logits and tokens as the separate
    packed modules (the lean forward off)."""
    model = tiny_model(family, seed=9, damp=0.1, dtype=torch.bfloat16)
    if lean.pack_linears(model)["reason"]:
        pytest.skip("no oneDNN bf16 here")
    ids = torch.tensor(PROMPT)
    model.lean = False
    separate = model.forward(ids, model.new_cache())
    model.lean = True
    fused = model.forward(ids, model.new_cache())
    slot = "_fused_panel" if avx512.unavailable(torch.bfloat16) is None else "_fused"  # whose packed copy
    assert slot in vars(model.layers[0].self_attn.q_proj) and slot in vars(model.layers[0].mlp.gate_proj)
    torch.testing.assert_close(fused, separate, rtol=0, atol=0.05)
    assert torch.equal(fused.argmax(-1), separate.argmax(-1))
    lean.unpack_linears(model)
    assert slot not in vars(model.layers[0].self_attn.q_proj)
