"""The compiled (inductor) layer parts: same tokens as eager on every path, and a clean fallback to eager."""

from __future__ import annotations

import pytest
import torch

from cats.draft import EarlyExitDrafter, PromptLookupDrafter
from cats.config import GenerationConfig
from cats.loop.generator import Generator
from cats.model.kernels import avx512
from cats.model.kernels import packing as lean
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
    assert outcome["packed"] == 7 * model.num_layers + 1  # q, k, v, o, gate, up, down; the lm_head
    assert model.packed and "forward" in vars(model.hf_model.lm_head)
    assert torch.equal(model.forward(ids, model.new_cache()), eager_logits)
    assert tokens(model, new=16) == eager
    assert tokens(model, PromptLookupDrafter(num_tokens=4), new=16) == eager
    with torch.no_grad():  # a changed weight is packed again
        model.layers[0].mlp.down_proj.weight.mul_(0.5)
    assert not torch.equal(model.forward(ids, model.new_cache()), eager_logits)
    lean.unpack_linears(model)
    assert "forward" not in vars(model.layers[0].mlp.down_proj)


def test_packing_is_for_bf16_and_float32_only():
    model = tiny_model("llama", seed=5)
    assert lean.pack_linears(model) == {"packed": 0,
                                        "reason": "prepacking is for bfloat16 and float32 weights, not torch.float64"}


@torch.no_grad()
def test_packed_model_packs_its_adapter_and_keeps_drafting_lossless():
    """An adapter on a packed target packs its block and its reduced-vocabulary head rows on first use, and early
    exit through it reproduces the packed model's own greedy tokens."""
    from cats.model.adapter import new_adapter

    model = tiny_model("llama", seed=6, damp=0.1, dtype=torch.bfloat16)
    torch.manual_seed(0)
    adapter = new_adapter(model, "draft", 1, vocab_subset=torch.randperm(VOCAB)[:48].tolist()).eval()
    if lean.pack_linears(model)["reason"]:
        pytest.skip("no oneDNN bf16 here")
    plain = tokens(model, new=16)
    assert tokens(model, EarlyExitDrafter(model, num_tokens=3, adapter=adapter), new=16) == plain
    assert adapter._packed and "forward" in vars(adapter.block.mlp.up_proj)
    assert adapter._head_rows in lean._PACKED or adapter._head_rows in lean._PANEL  # the head rows ran packed
    lean.unpack_linears(model)


@torch.no_grad()
def test_packing_off_runs_plain_linears():
    """`packing_off` (what cats bench's transformers baselines run under) never touches the packed copies."""
    model = tiny_model("llama", seed=7, damp=0.1, dtype=torch.bfloat16)
    if lean.pack_linears(model)["reason"]:
        pytest.skip("no oneDNN bf16 here")
    single, first = model.layers[0].self_attn.o_proj, model.layers[0].self_attn.q_proj
    # the linears run on the AVX-512 kernels' packed copies where they run here, else on oneDNN's
    copy, fused = ("_panel", "_fused_panel") if avx512.unavailable(torch.bfloat16) is None else ("_packed",
                                                                                                        "_fused")
    with lean.packing_off():
        tokens(model, new=4)
    assert not {"_packed", "_panel"} & set(vars(single)) and not {"_fused", "_fused_panel"} & set(vars(first))
    tokens(model, new=4)
    assert copy in vars(single) and fused in vars(first)  # q, k, v run as one fused packed GEMM
    assert "_packed" not in vars(first) and "_panel" not in vars(first)  # ... and q's own copies were never made
    lean.unpack_linears(model)
    assert not {"_packed", "_panel"} & set(vars(single)) and not {"_fused", "_fused_panel"} & set(vars(first))


def test_pack_weights_flag_refuses_what_it_cannot_do(tmp_path):
    from cats.errors import InvalidArgumentError
    from cats.model.load import load_model

    with pytest.raises(InvalidArgumentError, match="prepacking is for bfloat16 and float32 weights"):
        load_model(tmp_path, dtype="float16", pack_weights=True)
    with pytest.raises(InvalidArgumentError, match="memory budget does not plan for"):
        load_model(tmp_path, dtype="bfloat16", pack_weights=True, memory_budget="50%")


@torch.no_grad()
def test_packed_float32_reproduces_its_own_greedy_decoding():
    """float32 packing rounds in another order than aten (~1e-6): close logits, and every method on the packed model
    reproduces the packed model's own plain greedy tokens."""
    model = tiny_model("qwen2", seed=5, damp=0.1, dtype=torch.float32)
    ids = torch.tensor(PROMPT)
    plain_logits = model.forward(ids, model.new_cache())
    outcome = lean.pack_linears(model)
    if outcome["reason"]:
        pytest.skip(outcome["reason"])
    assert outcome["packed"] == 7 * model.num_layers + 1
    torch.testing.assert_close(model.forward(ids, model.new_cache()), plain_logits, rtol=1e-4, atol=1e-4)
    slot = "_fused_panel" if avx512.unavailable(torch.float32) is None else "_fused"  # whose packed copy
    assert slot in vars(model.layers[0].self_attn.q_proj)  # q, k, v fused on the packed path
    packed = tokens(model, new=16)
    for drafter in (PromptLookupDrafter(num_tokens=4), EarlyExitDrafter(model, layer=1, num_tokens=3)):
        assert tokens(model, drafter, new=16) == packed
    lean.unpack_linears(model)
