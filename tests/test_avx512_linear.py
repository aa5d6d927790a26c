"""The AVX-512 linear kernels: right answers on awkward shapes, row-invariant, what packed models run on, and a clean
fallback to oneDNN where they cannot run."""

from __future__ import annotations

import pytest
import torch

from cats.draft import PromptLookupDrafter
from cats.generate import GenerationConfig, Generator
from cats.model import lean, avx512_linear
from tests.conftest import VOCAB, tiny_model

DTYPES = (torch.bfloat16, torch.float32)
SHAPES = [(7, 50), (13, 576), (100, 33), (96, 64), (49, 31)]  # outputs off and on the 48-row panels, odd inputs


def needs(dtype):
    reason = avx512_linear.unavailable(dtype)
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
    out = avx512_linear.linear(hidden, avx512_linear.pack(weight), out_features,
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
    (tiles of 8, 4, 2 and 1 rows) and with the panels split over one or two threads."""
    needs(dtype)
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 577, generator=generator).to(dtype)
    packed = avx512_linear.pack(weight)
    hidden = torch.randn(23, 577, generator=generator).to(dtype)
    alone = torch.cat([avx512_linear.linear(hidden[i:i + 1], packed, 200) for i in range(len(hidden))])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (1, 2, 3, 5, 8, 9, 15, 23):
                assert torch.equal(avx512_linear.linear(hidden[:rows], packed, 200), alone[:rows])
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
    avx512_linear.KERNELS["off"] = True
    try:
        with_onednn = greedy()
    finally:
        avx512_linear.KERNELS["off"] = False
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
    monkeypatch.setitem(avx512_linear.KERNELS, "off", True)
    assert avx512_linear.unavailable(torch.bfloat16) == "switched off (CATS_KERNELS=0)"
    monkeypatch.setitem(avx512_linear.KERNELS, "off", False)
    assert avx512_linear.unavailable(torch.float16) == "no kernel for torch.float16"
    monkeypatch.setattr(avx512_linear, "_STATE", {})
    monkeypatch.setattr(avx512_linear, "_compiler", lambda: None)
    assert avx512_linear.unavailable(torch.float32).startswith(("no C compiler found", "the kernels are x86-64"))


@torch.no_grad()
def test_without_the_kernels_packed_linears_use_onednn(monkeypatch):
    monkeypatch.setattr(avx512_linear, "_STATE", {"library": None, "kinds": 0, "reason": "no C compiler found"})
    weight = torch.randn(12, 40).to(torch.bfloat16)
    hidden = torch.randn(1, 40).to(torch.bfloat16)
    assert not avx512_linear.usable(hidden, weight)
    if lean.pack_available(torch.bfloat16) is None:
        out = lean.packed_linear(hidden, weight)
        assert torch.equal(out, torch.nn.functional.linear(hidden, weight))
        assert weight in lean._PACKED and weight not in lean._PANEL
