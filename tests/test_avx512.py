"""The AVX-512 kernels (linears, attention for few queries): right answers on awkward shapes, row-invariant, what
packed models run on (so bf16 speculative decoding reproduces bf16 plain decoding bit for bit), and a clean fallback
to oneDNN / SDPA where they cannot run."""

from __future__ import annotations

import pytest
import torch

from cats.draft import PromptLookupDrafter
from cats.config import GenerationConfig
from cats.loop.generator import Generator
from cats.model.kernels import avx512, native
from cats.model.kernels import packing as lean
from tests.conftest import VOCAB, assert_drafters_reproduce_plain_decoding, tiny_model

DTYPES = (torch.bfloat16, torch.float32)
SHAPES = [(7, 50), (13, 576), (100, 33), (96, 64), (49, 31)]  # outputs off and on the 48-row panels, odd inputs


def needs(dtype):
    reason = avx512.unavailable(dtype)
    if reason is not None:
        pytest.skip(f"AVX-512 linear kernels: {reason}")


def reference(hidden, weight, bias):
    out = hidden.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_float64_reference(dtype, shape, with_bias):
    needs(dtype)
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(out_features * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype) if with_bias else None
    hidden = torch.randn(2, 3, in_features, generator=generator).to(dtype)  # 6 rows, leading dims kept
    out = avx512.linear(hidden, avx512.pack(weight), out_features,
                                    None if bias is None else bias.float())
    assert out.shape == (2, 3, out_features) and out.dtype == dtype
    expected = reference(hidden, weight, bias)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    else:  # a float32 sum rounded once to bf16: within one bf16 rounding (2^-8 relative) plus float32 noise
        assert ((out.double() - expected).abs() <= expected.abs() * 2 ** -8 + 1e-4).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_do_not_depend_on_their_neighbours(dtype):
    """Row-invariance, bit for bit: each row alone gives what it gives among others, for every tiling of the rows
    (tiles of 8, 4, 2 and 1 rows, groups of up to 64 rows working through a panel chunk by chunk) and with the panels
    split over one or two threads."""
    needs(dtype)
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 577, generator=generator).to(dtype)
    packed = avx512.pack(weight)
    hidden = torch.randn(130, 577, generator=generator).to(dtype)
    alone = torch.cat([avx512.linear(hidden[i:i + 1], packed, 200) for i in range(len(hidden))])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (1, 2, 3, 5, 8, 9, 15, 23, 57, 63, 64, 65, 71, 127, 130):  # (groups of 64 rows share chunks)
                assert torch.equal(avx512.linear(hidden[:rows], packed, 200), alone[:rows])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_packed_model_runs_on_the_kernels(dtype):
    """A packed model runs its linears on the kernels' copies alone (no oneDNN copy is made); every method
    reproduces the packed model's own greedy tokens, and a changed weight is packed again."""
    needs(dtype)
    model = tiny_model("qwen2", seed=8, damp=0.1, dtype=dtype)  # qwen2: q, k and v have biases
    if lean.pack_linears(model)["reason"]:
        pytest.skip("no oneDNN packing here")
    prompt = torch.randint(3, VOCAB, (8,), generator=torch.Generator().manual_seed(2)).tolist() * 2

    def greedy(drafter=None):
        return Generator(model, drafter).generate(prompt, GenerationConfig(max_new_tokens=16)).token_ids

    plain = greedy()
    down, query = model.layers[0].mlp.down_proj, model.layers[0].self_attn.q_proj
    assert "_panel" in vars(down) and "_packed" not in vars(down)
    assert "_fused_panel" in vars(query) and "_fused" not in vars(query)
    assert greedy(PromptLookupDrafter(num_tokens=4)) == plain
    avx512.KERNELS["off"] = True
    try:
        with_onednn = greedy()
    finally:
        avx512.KERNELS["off"] = False
    if dtype == torch.float32:  # another summation order: tiny differences, the same tokens on this model
        assert with_onednn == plain
    ids = torch.tensor(prompt)
    step = ids[:1]
    before = model.forward(step, model.new_cache())
    down.weight.mul_(0.5)
    assert not torch.equal(model.forward(step, model.new_cache()), before)
    lean.unpack_linears(model)
    assert not {"_panel", "_packed", "forward"} & set(vars(down))


def test_unavailable_says_why(monkeypatch):
    monkeypatch.setitem(avx512.KERNELS, "off", True)
    assert avx512.unavailable(torch.bfloat16) == "switched off (CATS_KERNELS=0)"
    monkeypatch.setitem(avx512.KERNELS, "off", False)
    assert avx512.unavailable(torch.float16) == "no kernel for torch.float16"
    monkeypatch.setattr(avx512, "_STATE", {})
    monkeypatch.setattr(native, "compiler", lambda: None)
    assert avx512.unavailable(torch.float32).startswith(("no C compiler found", "the kernels are x86-64"))


def test_an_unwritable_kernel_cache_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    if native.compiler() is None or avx512.platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("no compiler / not x86-64: the build is never tried")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("CATS_CACHE", str(blocker / "cache"))  # a folder under a file: cannot be made
    monkeypatch.setattr(avx512, "_STATE", {})
    reason = avx512.unavailable(torch.float32)
    assert reason.startswith("building avx512.c in") and "a-file" in reason


@torch.no_grad()
def test_without_the_kernels_packed_linears_use_onednn(monkeypatch):
    monkeypatch.setattr(avx512, "_STATE", {"library": None, "kinds": 0, "reason": "no C compiler found"})
    weight = torch.randn(12, 40).to(torch.bfloat16)
    hidden = torch.randn(1, 40).to(torch.bfloat16)
    assert not avx512.usable(hidden, weight)
    if lean.pack_available(torch.bfloat16) is None:
        out = lean.packed_linear(hidden, weight)
        assert torch.equal(out, torch.nn.functional.linear(hidden, weight))
        assert weight in lean._PACKED and weight not in lean._PANEL


def attention_case(dtype, heads, kv_heads, queries, keys, dim, seed):
    generator = torch.Generator().manual_seed(seed)
    # K/V as strided views of longer buffers, like the slot cache's; q as a transposed view, like the lean forward's
    key = torch.randn(1, kv_heads, keys + 7, dim, generator=generator).to(dtype)[:, :, :keys]
    value = torch.randn(1, kv_heads, keys + 7, dim, generator=generator).to(dtype)[:, :, :keys]
    query = torch.randn(1, queries, heads, dim, generator=generator).to(dtype).transpose(1, 2)
    return query, key, value


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 3, 1, 300, 64), (9, 3, 8, 41, 64), (4, 4, 5, 37, 128), (8, 2, 17, 100, 64),
                                   (12, 2, 3, 40, 64), (8, 2, 2, 33, 128), (4, 2, 3, 50, 96)])  # heads per KV head:
# 3, 3, 1, 4, 6 (two passes of at most four), 4, 2; head sizes 64, 128 and 96 (the kernels' generic size)
def test_attention_matches_float64_reference(dtype, shape):
    needs(dtype)
    heads, kv_heads, queries, keys, dim = shape
    query, key, value = attention_case(dtype, heads, kv_heads, queries, keys, dim, seed=queries * keys)
    visible = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    mask = torch.zeros(queries, keys).masked_fill(~visible, torch.finfo(dtype).min)
    assert avx512.attention_usable(query, key, mask)
    out = avx512.attention(query, key, value, mask if queries > 1 else None, dim ** -0.5)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.double(), key.double(), value.double(), attn_mask=mask.double(), scale=dim ** -0.5,
        enable_gqa=True).transpose(1, 2).reshape(1, queries, heads * dim)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_of_a_query_ignores_hidden_keys_bit_for_bit(dtype):
    """A query among others, under a tree-like mask (its visible keys interleaved with hidden ones), gets exactly
    what it gets alone over only its visible keys, in order: what makes a tree verification's accepted token equal
    to the same token decoded alone."""
    needs(dtype)
    heads, kv_heads, keys, dim = 6, 2, 90, 64
    query, key, value = attention_case(dtype, heads, kv_heads, 5, keys, dim, seed=5)
    generator = torch.Generator().manual_seed(6)
    visible = torch.rand(5, keys, generator=generator) < 0.6
    visible[:, 0] = True
    mask = torch.zeros(5, keys).masked_fill(~visible, torch.finfo(dtype).min)
    together = avx512.attention(query, key, value, mask, 0.125)
    for t in range(5):
        shown = visible[t].nonzero().flatten()
        alone = avx512.attention(query[:, :, t:t + 1], key[:, :, shown], value[:, :, shown], None, 0.125)
        assert torch.equal(alone[0, 0], together[0, t])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_beyond_one_kernel_call_runs_in_chunks_that_change_no_bit(dtype):
    """150 causal queries (chunks of 64, 64 and 22): each gets exactly what it gets alone over the keys it sees; a
    mask that shows a query a later new token cannot be chunked, and says so."""
    needs(dtype)
    queries, keys = 150, 170
    query, key, value = attention_case(dtype, 4, 2, queries, keys, 64, seed=7)
    visible = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    mask = torch.zeros(queries, keys).masked_fill(~visible, torch.finfo(dtype).min)
    assert queries > 2 * avx512.ATTENTION_QUERY_LIMIT and avx512.attention_usable(query, key, mask)
    together = avx512.attention(query, key, value, mask, 0.125)
    for t in (0, 63, 64, 100, 149):
        seen = keys - queries + t + 1
        alone = avx512.attention(query[:, :, t:t + 1], key[:, :, :seen], value[:, :, :seen], None, 0.125)
        assert torch.equal(alone[0, 0], together[0, t])
    mask[3, keys - 1] = 0.0  # query 3 would see the last new token
    with pytest.raises(ValueError, match="see later new tokens"):
        avx512.attention(query, key, value, mask, 0.125)


@torch.no_grad()
def test_packed_bf16_speculation_reproduces_packed_plain_decoding_bit_for_bit():
    """With row-invariant linears and attention, a bf16 token's logits are the same bits whether its forward carries
    it alone, in a chain or in a tree: every method's greedy tokens equal plain decoding's, and a verification's
    rows equal the one-token forwards' logits exactly."""
    needs(torch.bfloat16)
    model = tiny_model("llama", seed=10, damp=0.1, dtype=torch.bfloat16)
    if lean.pack_linears(model)["reason"]:
        pytest.skip("no oneDNN packing here")
    prompt = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    ids = torch.tensor(prompt)
    cache = model.new_cache()
    model.forward(ids[:4], cache)
    chain = model.forward(ids[4:12], cache)  # 8 tokens at once
    cache = model.new_cache()
    model.forward(ids[:4], cache)
    one_by_one = torch.stack([model.forward(ids[i:i + 1], cache)[0] for i in range(4, 12)])
    assert torch.equal(chain, one_by_one)
    assert_drafters_reproduce_plain_decoding(model, prompt)
    lean.unpack_linears(model)


@pytest.mark.parametrize("shape", [(12, 2, 1, 300, 128), (12, 2, 3, 77, 128), (9, 3, 1, 120, 64), (9, 3, 4, 60, 64),
                                   (14, 2, 2, 50, 128), (16, 2, 1, 40, 128), (8, 1, 2, 45, 96)])
def test_float32_attention_of_a_head_does_not_depend_on_the_heads_beside_it(shape):
    """The float32 kernel computes the query heads of a KV head together (sharing each load of K and V): every head
    still gets the bits it gets alone, whatever the group size (6, 3, 7, 8, 8), head size and number of queries."""
    needs(torch.float32)
    heads, kv_heads, queries, keys, dim = shape
    query, key, value = attention_case(torch.float32, heads, kv_heads, queries, keys, dim, seed=heads * keys)
    visible = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    mask = torch.zeros(queries, keys).masked_fill(~visible, torch.finfo(torch.float32).min)
    together = avx512.attention(query, key, value, mask if queries > 1 else None, 0.09)
    groups = heads // kv_heads
    for h in range(heads):
        g = h // groups
        alone = avx512.attention(query[:, h:h + 1], key[:, g:g + 1], value[:, g:g + 1],
                                 mask if queries > 1 else None, 0.09)
        assert torch.equal(alone[0], together[0, :, h * dim:(h + 1) * dim])
