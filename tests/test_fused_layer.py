"""The whole-layer kernel (`cats.model.kernels.layer_forward.fused_layer_forward` on `avx512.layer`): a packed Llama-style
layer over a few tokens in one C call. It must compute what the lean forward computes (the same kernels; its own
norm and SiLU rounding), stay row-invariant, leave its caller's tensors alone, and fall back where it cannot run."""

import pytest
import torch

from cats.config import GenerationConfig
from cats.loop.generator import Generator
from cats.model import LayeredModel, layered
from cats.model.kernels import avx512
from cats.model.kernels import packing as lean
from cats.model.kernels.layer_forward import fused_unsupported
from conftest import COMMON, VOCAB, assert_drafters_reproduce_plain_decoding, tiny_model, whole_layer_calls

DTYPES = [torch.bfloat16, torch.float32]


def needs(dtype):
    reason = avx512.unavailable(dtype)
    if reason is not None:
        pytest.skip(f"AVX-512 kernels unavailable: {reason}")


def model_with_wide_heads(family: str, dtype, seed: int = 0) -> LayeredModel:
    """A 4-layer model of ``family`` with 2 query heads of 32 (bf16 attention needs D % 32 == 0) and one KV head."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(COMMON, num_attention_heads=2, num_key_value_heads=1)
    config = {"llama": lambda: LlamaConfig(**common),
              "qwen2": lambda: Qwen2Config(**common),  # biases on q, k and v
              "mistral-swa": lambda: MistralConfig(**common, sliding_window=6)}[family]()
    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():  # shallow layers that often agree with the full model: drafts get accepted
        for layer in hf_model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    model = LayeredModel(hf_model.eval(), tokenizer=None, name=f"wide-{family}")
    if lean.pack_linears(model)["reason"]:
        pytest.skip("no packing here")
    return model


def run(model: LayeredModel, fused: bool, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Logits of each chunk of tokens, fed one forward after another into one cache, with the whole-layer kernel on
    or off."""
    saved = model._fused_layers
    model._fused_layers = [fused and flag for flag in saved]
    try:
        cache = model.new_cache()
        return [model.forward(chunk, cache) for chunk in chunks]
    finally:
        model._fused_layers = saved


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral-swa"])
@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_fused_layer_computes_what_the_lean_forward_computes(family, dtype):
    needs(dtype)
    model = model_with_wide_heads(family, dtype)
    assert all(model._fused_layers)
    ids = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(1))
    chunks = [ids[:9], ids[9:10], ids[10:16], ids[16:17]]  # a prompt, steps, a chain; the window slides (6)
    with whole_layer_calls() as calls:
        fused = run(model, True, chunks)
    # every forward ran its 4 layers in one call
    assert [(len(specs), tokens) for specs, tokens in calls] == [(4, 9), (4, 1), (4, 6), (4, 1)]
    lean_logits = run(model, False, chunks)
    tolerance = dict(atol=0.05, rtol=0.05) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    for a, b in zip(fused, lean_logits):
        torch.testing.assert_close(a, b, **tolerance)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_fused_layer_is_row_invariant_and_leaves_its_input_alone(dtype):
    """A chain of 8 tokens gives the bits of 8 one-token forwards; a tree-masked query the bits of its path alone;
    the caller's hidden states are not overwritten."""
    needs(dtype)
    model = model_with_wide_heads("llama", dtype, seed=3)
    ids = torch.randint(3, VOCAB, (14,), generator=torch.Generator().manual_seed(5))
    chain = run(model, True, [ids[:6], ids[6:14]])[1]
    singles = torch.cat(run(model, True, [ids[:6]] + [ids[i:i + 1] for i in range(6, 14)])[1:])
    assert torch.equal(chain, singles)
    # a tree: nodes 0 and 1 are siblings after the prompt, node 2 a child of node 1; node 2 sees slots [0, 6), 7
    cache = model.new_cache()
    model.forward(ids[:6], cache)
    attend = torch.zeros(3, 9, dtype=torch.bool)
    attend[:, :6] = True
    attend[0, 6] = attend[1, 7] = attend[2, 7] = attend[2, 8] = True
    tree = model.forward(ids[6:9], cache, position_ids=torch.tensor([6, 6, 7]), attend=attend)
    path = run(model, True, [ids[:6], ids[7:8], ids[8:9]])
    assert torch.equal(tree[1], path[1][0]) and torch.equal(tree[2], path[2][0])
    hidden = model.embed(ids[:4])
    before = hidden.clone()
    model.forward_layers(hidden, 0, model.num_layers, model.new_cache())
    assert torch.equal(hidden, before)


@torch.no_grad()
def test_fused_layer_speculation_reproduces_plain_decoding_bit_for_bit():
    needs(torch.bfloat16)
    model = model_with_wide_heads("qwen2", torch.bfloat16, seed=4)
    prompt = torch.randint(3, VOCAB, (10,), generator=torch.Generator().manual_seed(6)).tolist() * 2
    assert_drafters_reproduce_plain_decoding(model, prompt)


@torch.no_grad()
def test_fused_layer_follows_a_changed_weight_and_falls_back_where_it_cannot_run():
    needs(torch.float32)
    model = model_with_wide_heads("llama", torch.float32, seed=7)
    ids = torch.randint(3, VOCAB, (70,), generator=torch.Generator().manual_seed(8))
    before = run(model, True, [ids[:5]])[0]
    model.layers[2].mlp.up_proj.weight.mul_(0.5)
    after = run(model, True, [ids[:5]])[0]
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, run(model, False, [ids[:5]])[0], atol=1e-5, rtol=1e-5)
    with whole_layer_calls() as calls:
        long = run(model, True, [ids[:5], ids[5:70]])[1]  # 65 tokens: above ATTENTION_QUERY_LIMIT, in two calls
    # the prompt's 4 layers in one call, then the 65 tokens layer by layer, each in two calls
    assert [(len(specs), tokens) for specs, tokens in calls] == [(4, 5)] + [(1, avx512.ATTENTION_QUERY_LIMIT), (1, 1)] * 4
    assert torch.equal(long, torch.cat(run(model, True, [ids[:5]] + [ids[i:i + 1] for i in range(5, 70)])[1:]))
    torch.testing.assert_close(long, run(model, False, [ids[:5], ids[5:70]])[1], atol=1e-5, rtol=1e-5)
    lean.unpack_linears(model)
    assert model.layers[0] not in lean.LAYER_SPECS
    assert fused_unsupported(tiny_model("qwen3").layers[0]) == "Qwen3DecoderLayer has no whole-layer kernel"
    assert fused_unsupported(tiny_model("phi3").layers[0]) == "Phi3DecoderLayer has no whole-layer kernel"


@torch.no_grad()
def test_a_feature_adapter_drafts_on_packed_kernels_and_stays_lossless():
    """A feature (eagle) adapter on a packed bf16 model packs its input projection and block too, its block runs on
    the whole-layer kernel, and its trees reproduce plain decoding bit for bit."""
    needs(torch.bfloat16)
    from cats.model.adapter import new_adapter
    from cats.draft.eagle import FeatureDrafter

    model = model_with_wide_heads("llama", torch.bfloat16, seed=9)
    adapter = new_adapter(model, "draft", model.num_layers, input="features")
    with torch.no_grad():  # its estimate of the next feature: layer 0 on the next token's embedding
        size = model.config.hidden_size
        adapter.fc.weight.zero_()
        adapter.fc.weight[:, size:] = torch.eye(size, dtype=adapter.fc.weight.dtype)
        adapter.block.load_state_dict(model.layers[0].state_dict())
    adapter = adapter.to(torch.bfloat16).eval().requires_grad_(False)
    prompt = torch.randint(3, VOCAB, (10,), generator=torch.Generator().manual_seed(3)).tolist() * 2
    plain = Generator(model).generate(prompt, GenerationConfig(max_new_tokens=24)).token_ids
    with whole_layer_calls() as calls:
        drafted = Generator(model, FeatureDrafter(model, adapter, tree_topk=2, total_tokens=6, depth=3)).generate(
            prompt, GenerationConfig(max_new_tokens=24))
    assert drafted.token_ids == plain and drafted.stats.accepted_draft_tokens > 0
    assert lean.is_packed(adapter.fc) and lean.is_packed(adapter.block.mlp.down_proj)
    assert lean.LAYER_SPECS[adapter.block][0] in [spec for specs, _ in calls for spec in specs]  # the block ran on it


@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_a_forward_runs_its_layers_in_one_call_with_the_bits_of_a_call_per_layer(dtype, monkeypatch):
    """Resident layers on the whole-layer kernel run in one C call per forward, split where a state is captured;
    the hidden states, captured states and cache are those of one call per layer, bit for bit."""
    needs(dtype)
    model = model_with_wide_heads("mistral-swa", dtype, seed=12)
    ids = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(13))

    def forwards() -> tuple[list, list]:
        cache, outputs, captured = model.new_cache(), [], []
        for chunk in (ids[:9], ids[9:10], ids[10:12]):  # a prompt, a step, a chain (the window slides: 6)
            capture = {1: None, 3: None}
            outputs.append(model.forward_layers(model.embed(chunk), 0, model.num_layers, cache, capture=capture))
            captured.append(capture)
        return outputs + [cache.hf_cache.layers[i].keys for i in range(model.num_layers)], captured

    with whole_layer_calls() as calls:
        together, captured = forwards()
    assert [(len(specs), tokens) for specs, tokens in calls] == [(1, 9), (2, 9), (1, 9), (1, 1), (2, 1), (1, 1),
                                                                (1, 2), (2, 2), (1, 2)]
    monkeypatch.setattr(layered, "fused_layers_forward", lambda *args: False)
    with whole_layer_calls() as calls:
        apart, captured_apart = forwards()
    assert [len(specs) for specs, _ in calls] == [1] * 12
    assert all(torch.equal(a, b) for a, b in zip(together, apart))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(captured, captured_apart) for k in (1, 3))
