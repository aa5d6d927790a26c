"""The linears on GGUF blocks (`cats.model.kernels.quantized`), each instruction-set path forced: every type against
gguf-py's dequantisation with the activations rounded as the kernels round them, row-invariance, bias, bad input."""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from cats.model.kernels import quantized

QUANTISED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
FLOATS = ["F32", "F16", "BF16"]
SCALE_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
                 "Q5_K": [0, 2], "Q6_K": [208]}  # where each block keeps its float16 scales (and mins)


def _paths():
    return [pytest.param(isa, marks=pytest.mark.skipif(quantized.choose(isa)[0] is None,
                                                        reason=f"the {isa} kernels do not run here"))
            for isa in quantized.ISAS]


@pytest.fixture(params=_paths())
def path(request):
    quantized.use(request.param)
    yield request.param
    quantized.use(None)


def random_tensor(name: str, rows: int, columns: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """``(stored rows uint8 [rows, row bytes], their values float64 [rows, columns])``: random bits for every
    quantised field, small float16 scales."""
    if name in FLOATS:
        values = rng.standard_normal((rows, columns)).astype(np.float32)
        if name == "F16":
            values = values.astype(np.float16).astype(np.float32)
            return values.astype(np.float16).view(np.uint8).reshape(rows, -1), values.astype(np.float64)
        if name == "BF16":
            bits = (values.view(np.uint32) >> 16).astype(np.uint16)
            return bits.view(np.uint8).reshape(rows, -1), (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return values.view(np.uint8).reshape(rows, -1), values.astype(np.float64)
    kind = GGMLQuantizationType[name]
    values_per_block, block_bytes = GGML_QUANT_SIZES[kind]
    blocks = columns // values_per_block
    raw = rng.integers(0, 256, size=(rows, blocks, block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[name]:
        scales = (rng.standard_normal((rows, blocks)) * 0.01).astype(np.float16)
        raw[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, blocks, 2)
    raw = raw.reshape(rows, -1)
    return raw, dequantize(raw, kind).reshape(rows, columns).astype(np.float64)


def rounded_activations(x: np.ndarray, block: int) -> np.ndarray:
    """What the kernels multiply: each row in blocks of ``block`` values, scale max|x| / 127, rounded to nearest even."""
    if block == 1:
        return x.astype(np.float64)
    grouped = x.astype(np.float32).reshape(x.shape[0], -1, block)
    top = np.abs(grouped).max(-1, keepdims=True)
    inverse = np.where(top > 0, np.float32(127) / np.where(top > 0, top, 1), 0).astype(np.float32)
    levels = np.clip(np.rint(grouped * inverse), -127, 127)
    return (levels * (top / np.float32(127))).reshape(x.shape).astype(np.float64)


def run(x: np.ndarray, raw: np.ndarray, name: str, bias: np.ndarray | None = None) -> np.ndarray:
    code = quantized.TYPES[name]
    return quantized.linear(torch.from_numpy(x), torch.from_numpy(raw), code, x.shape[-1],
                            None if bias is None else torch.from_numpy(bias)).numpy()


@pytest.mark.parametrize("name", QUANTISED + FLOATS)
@pytest.mark.parametrize("rows,columns,tokens", [(37, 768, 5), (50, 512, 9), (3, 256, 1)])
def test_each_type_computes_the_dequantised_product(path, name, rows, columns, tokens):
    rng = np.random.default_rng(zlib.crc32(f"{name} {rows}".encode()))
    raw, weights = random_tensor(name, rows, columns, rng)
    x = rng.standard_normal((tokens, columns)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    out = run(x, raw, name, bias)
    reference = rounded_activations(x, quantized.BLOCK_VALUES[quantized.TYPES[name]]) @ weights.T + bias
    assert out.shape == (tokens, rows)
    np.testing.assert_allclose(out, reference, rtol=0, atol=2e-6 * np.abs(reference).max())


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q5_1", "F16"])
def test_an_odd_number_of_32_value_blocks(path, name):
    rng = np.random.default_rng(1)
    raw, weights = random_tensor(name, 20, 32 * 9, rng)  # 9 blocks: the last pair is half empty
    x = rng.standard_normal((3, 32 * 9)).astype(np.float32)
    reference = rounded_activations(x, quantized.BLOCK_VALUES[quantized.TYPES[name]]) @ weights.T
    np.testing.assert_allclose(run(x, raw, name), reference, rtol=0, atol=2e-6 * np.abs(reference).max())


@pytest.mark.parametrize("name", QUANTISED + FLOATS)
def test_a_tokens_output_does_not_depend_on_the_others(path, name):
    """Row-invariant: each row computed alone, or among 1..36 others, gives the same bits (every count of tokens
    below the largest tile has a kernel of its own: 37 are taken 16 + 16 + 5 on the k-quants' lanes, the two full
    tiles from rows decoded once (a prompt's path), 8 + 8 + 8 + 8 + 5 on the other blocks, 4 at a time on float rows;
    768 columns: 3 blocks of 256, so a k-quant row's 8 offsets per block end in half a vector)."""
    rng = np.random.default_rng(2)
    raw, _ = random_tensor(name, 33, 768, rng)
    x = rng.standard_normal((37, 768)).astype(np.float32)
    together = run(x, raw, name)
    for count in range(1, 37):
        assert np.array_equal(run(x[:count], raw, name), together[:count])
    for row in range(37):
        assert np.array_equal(run(x[row:row + 1], raw, name)[0], together[row])


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_long_rows_decoded_a_few_at_a_time_give_each_token_its_own_bits(path, name):
    """A prompt's k-quant rows are decoded once, as many at a time as fit the kernels' budget, and taken in pairs:
    rows of 64 blocks fit 9 at a time, so a chunk of 16 rows is decoded as 9 + 7, and each group ends in a row
    paired with itself. 43 tokens: 40 in tiles of 8 from the decoded rows, 3 on the rows' own loop. Every token's
    output equals what it gets alone, and the dequantised product."""
    rng = np.random.default_rng(4)
    raw, weights = random_tensor(name, 20, 64 * 256, rng)
    x = rng.standard_normal((43, 64 * 256)).astype(np.float32)
    together = run(x, raw, name)
    reference = rounded_activations(x, 256) @ weights.T
    np.testing.assert_allclose(together, reference, rtol=0, atol=2e-6 * np.abs(reference).max())
    for row in (0, 8, 9, 39, 40, 42):
        assert np.array_equal(run(x[row:row + 1], raw, name)[0], together[row])


def test_the_paths_agree_closely():
    """The AVX-512, AMX and AVX2 builds compute the same products (summation orders differ: last bits only)."""
    if any(quantized.choose(isa)[0] is None for isa in quantized.ISAS):
        pytest.skip("every path must run here")
    rng = np.random.default_rng(3)
    raw, _ = random_tensor("Q4_K", 32, 512, rng)
    x = rng.standard_normal((12, 512)).astype(np.float32)
    outs = []
    for isa in quantized.ISAS:
        quantized.use(isa)
        outs.append(run(x, raw, "Q4_K"))
    quantized.use(None)
    for out in outs[1:]:
        np.testing.assert_allclose(out, outs[0], rtol=0, atol=2e-6 * np.abs(outs[0]).max())


def _tiles_granted() -> bool:
    """Whether this process holds the AMX tile registers (arch_prctl ARCH_GET_XCOMP_PERM, bit XFEATURE_XTILEDATA)."""
    bits = ctypes.c_ulong(0)
    ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(bits))  # SYS_arch_prctl on x86-64
    return bool(bits.value & (1 << 18))


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K"])
def test_the_tiles_give_each_token_what_the_vectors_give_it_alone(name):
    """The AMX build: 8 or more tokens on 16-row chunks go through the tiles, fewer through the vectors; a token's
    output is the same bits either way, for every chunk and every count of tokens."""
    if quantized.choose("amx")[0] is None:
        pytest.skip(f"the amx kernels do not run here: {quantized.choose('amx')[1]}")
    quantized.use("amx")
    try:
        rng = np.random.default_rng(5)
        raw, weights = random_tensor(name, 48, 1024, rng)
        x = rng.standard_normal((20, 1024)).astype(np.float32)
        together = run(x, raw, name)
        reference = rounded_activations(x, 256) @ weights.T
        np.testing.assert_allclose(together, reference, rtol=0, atol=2e-6 * np.abs(reference).max())
        assert _tiles_granted()  # the tiles ran: Linux lent this process the tile registers
        for count in (8, 9, 16, 17):
            assert np.array_equal(run(x[:count], raw, name), together[:count])
        for row in range(20):
            assert np.array_equal(run(x[row:row + 1], raw, name)[0], together[row])
    finally:
        quantized.use(None)


def test_a_row_length_off_the_block_is_refused(path):
    raw, _ = random_tensor("Q4_K", 4, 256, np.random.default_rng(4))
    with pytest.raises(ValueError, match="Q4_K rows of 200 values"):
        quantized.linear(torch.zeros(1, 200), torch.from_numpy(raw), quantized.TYPES["Q4_K"], 200)
    assert not quantized.supports(quantized.TYPES["Q4_K"], 200) and quantized.supports(quantized.TYPES["Q4_0"], 96)
    assert not quantized.supports(99, 256)  # a type without a kernel


def test_an_unknown_instruction_set_is_named():
    isa, reason = quantized.choose("sse9")
    assert isa is None and "unknown instruction set 'sse9'" in reason


def test_switched_off_says_so(monkeypatch):
    monkeypatch.setenv("CATS_KERNELS", "0")
    assert quantized.choose() == (None, "switched off (CATS_KERNELS=0)")


def test_several_linears_in_one_call_are_the_separate_calls_side_by_side(path):
    rng = np.random.default_rng(5)
    parts = [(name, *random_tensor(name, rows, 512, rng), rng.standard_normal(rows).astype(np.float32) if bias else None)
             for name, rows, bias in (("Q4_K", 20, True), ("Q6_K", 7, False), ("Q8_0", 5, True), ("F16", 3, False))]
    group = quantized.Group([(torch.from_numpy(raw), quantized.TYPES[name], None if b is None else torch.from_numpy(b))
                             for name, raw, _, b in parts], 512)
    x = rng.standard_normal((6, 512)).astype(np.float32)
    together = quantized.linears(torch.from_numpy(x), group).numpy()
    separate = np.concatenate([run(x, raw, name, b) for name, raw, _, b in parts], axis=1)
    assert together.shape == (6, 35) and np.array_equal(together, separate)


@pytest.mark.parametrize("threads", [2, 3, 5, 8])
def test_every_row_is_computed_once_whichever_thread_takes_it(path, threads):
    """The team shares a call's chunks of 16 rows (each thread its range, then the last chunks left in the others'):
    with more threads than cores the threads run by turns and take each other's chunks, and every output is still
    computed, with the bits one thread gives it (a group of four types, 1 and 3 tokens, 61 chunks)."""
    rng = np.random.default_rng(7)
    parts = [(name, *random_tensor(name, rows, 512, rng)[:1]) for name, rows in
             (("Q4_K", 300), ("Q6_K", 301), ("Q8_0", 170), ("F16", 190))]
    group = quantized.Group([(torch.from_numpy(raw), quantized.TYPES[name], None) for name, raw in parts], 512)
    saved = torch.get_num_threads()
    for tokens in (1, 3):
        x = torch.from_numpy(rng.standard_normal((tokens, 512)).astype(np.float32))
        try:
            torch.set_num_threads(1)
            alone = quantized.linears(x, group)
            torch.set_num_threads(threads)
            shared = [quantized.linears(x, group) for _ in range(20)]
        finally:
            torch.set_num_threads(saved)
        assert all(torch.equal(result, alone) for result in shared)


@pytest.mark.parametrize("name", QUANTISED + FLOATS)
def test_rows_as_floats_are_gguf_pys_bit_for_bit(path, name):
    """`dequantized_rows` (an embedding's lookup) gives the values of gguf-py's dequantisation, every bit (random
    bits in every field, so a product fused with its sum into one rounding would show), for all rows or any rows."""
    rng = np.random.default_rng(zlib.crc32(f"rows {name}".encode()))
    raw, _ = random_tensor(name, 24, 512, rng)
    expected = dequantize(raw, GGMLQuantizationType[name]).reshape(24, 512).astype(np.float32)
    blocks, code = torch.from_numpy(raw), quantized.TYPES[name]
    every = quantized.dequantized_rows(blocks, code, 512).numpy()
    assert np.array_equal(every.view(np.uint32), expected.view(np.uint32))
    picked = quantized.dequantized_rows(blocks, code, 512, torch.tensor([[5, 0], [23, 5]])).numpy()
    assert np.array_equal(picked.view(np.uint32), expected[[5, 0, 23, 5]].view(np.uint32))
    with pytest.raises(IndexError, match="outside"):
        quantized.dequantized_rows(blocks, code, 512, torch.tensor([24]))
    with pytest.raises(IndexError, match="outside"):
        quantized.dequantized_rows(blocks, code, 512, torch.tensor([-1]))
