"""A GGUF file run on its own blocks: memory-mapped, no float copy, the same model as its dequantised float path, the
float path on request (``kernels="aten"``) and as the fallback where the kernels cannot run."""

from __future__ import annotations

import gguf
import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

import cats
from cats.bench.methods import BenchContext, CatsMethod
from cats.config import GenerationConfig
from cats.draft import PromptLookupDrafter, TreeDrafter
from cats.draft.recycle import TokenRecyclingDrafter
from cats.errors import InvalidArgumentError
from cats.loop.generator import Generator
from cats.model import gguf_model
from cats.model.gguf_names import shared_name_maps
from cats.model.kernels import avx512, quantized
from cats.method_needs import HeldAs
from cats.model.adapter import load_adapter, new_adapter
from cats.model.kernels.gguf_modules import (STORED_FLOAT_TYPES, GGUFEmbedding, GGUFLinear, StoredLinear,
                                           stored_linears)
from cats.model.source import gguf_metadata
from cats.model.weights.rss import page_cache_bytes
from cats.prompts import encode_prompt
from tests.conftest import SMOLLM2, STORIES_GGUF, STORIES_HF, needs, proposal_sizes, tiny_config, whole_layer_calls

pytestmark = pytest.mark.skipif(quantized.unavailable() is not None, reason=f"kernels: {quantized.unavailable()}")
SMOLLM2_FILE = SMOLLM2 / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2_blocks():
    return cats.load_model(SMOLLM2)


@needs(SMOLLM2)
def test_the_default_runs_the_files_blocks_without_a_float_copy(smollm2_blocks):
    model = smollm2_blocks
    assert model.weight_format == "GGUF Q4_1+Q8_0" and model.kernel_path.startswith("gguf-blocks/")
    assert model.dtype == torch.float32
    linears = [m for m in model.hf_model.modules() if isinstance(m, GGUFLinear)]
    assert len(linears) == 30 * 7 + 1 and isinstance(model.decoder.embed_tokens, GGUFEmbedding)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.hf_model.modules())
    index = gguf_model.tensor_index(gguf_metadata(SMOLLM2_FILE))["tensors"]
    file_bytes = sum(entry["bytes"] for entry in index.values())
    held = {p.data_ptr(): p for p in model.hf_model.parameters()}  # the tied head shares the embedding's rows
    held_bytes = sum(t.numel() * t.element_size() for t in held.values())
    assert abs(held_bytes - file_bytes) <= 0.05 * file_bytes
    ranges = [tuple(int(part, 16) for part in line.split()[0].split("-"))
              for line in open("/proc/self/maps") if line.rstrip().endswith(str(SMOLLM2_FILE.resolve()))]
    mapped = [t for t in held.values() if any(low <= t.data_ptr() < high for low, high in ranges)]
    assert len(mapped) == len(held)  # every weight, norm included, is a view of the file: no copy
    reordered = [m for m in linears if m.order is not None]  # Llama's q and k, stored in llama.cpp's row order
    assert len(reordered) == 2 * 30


@needs(SMOLLM2)
def test_loading_reads_the_whole_file_in_and_says_how_it_is_paged(smollm2_blocks):
    """Loaded without a budget, every page of the file is in memory before the first token, and the model records
    how much of it the kernel mapped in 2 MiB pages, which the bench's reports name beside the kernels."""
    mapping = smollm2_blocks.hf_model.gguf_mapping
    assert page_cache_bytes([mapping.path]) >= mapping.size  # (whole pages: the last one rounds up)
    pages = smollm2_blocks.large_pages
    assert pages is not None and 0 < pages.alignable_bytes <= mapping.size and 0.0 <= pages.share <= 1.0
    weights = CatsMethod("ar", BenchContext(model=smollm2_blocks, model_source=str(SMOLLM2))).describe()["weights"]
    assert weights.endswith(f"{pages.share:.0%} in 2 MiB pages") and weights.startswith("GGUF Q4_1+Q8_0, gguf-blocks/")


@needs(SMOLLM2)
def test_the_blocks_compute_what_the_dequantised_float_model_computes(smollm2_blocks):
    floats = cats.load_model(SMOLLM2, kernels="aten")
    assert floats.weight_format == "float32" and floats.kernel_path == "aten"
    ids = torch.tensor(floats.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"])
    with torch.no_grad():
        reference = floats.forward(ids, floats.new_cache())
        blocks = smollm2_blocks.forward(ids, smollm2_blocks.new_cache())
    assert torch.equal(blocks.argmax(-1), reference.argmax(-1))
    assert (blocks - reference).abs().max() < 0.05 * reference.abs().max()  # 8-bit activations: close, not equal
    for name in ("embed_tokens",):
        rows = getattr(smollm2_blocks.decoder, name)(ids)
        assert torch.equal(rows, getattr(floats.decoder, name)(ids))  # gguf-py's dequantisation on both paths


def forwards(model, chunks, fused: bool) -> list[torch.Tensor]:
    """Logits of each chunk of tokens fed one forward after another into one cache, each layer on the whole-layer
    kernel (``fused``) or on the lean forward's torch ops and kernel calls."""
    saved = model._fused_layers
    model._fused_layers = [fused and flag for flag in saved]
    try:
        cache = model.new_cache()
        with torch.no_grad():
            return [model.forward(chunk, cache) for chunk in chunks]
    finally:
        model._fused_layers = saved


@needs(SMOLLM2)
def test_the_whole_layer_kernel_runs_the_blocks_as_the_lean_forward_does(smollm2_blocks):
    """Forwards of up to 64 tokens run each layer in one C call whose linears are the block kernels (q and k put back
    in transformers' order inside it): the lean forward's logits up to the rounding of the elementwise steps (which
    can move an 8-bit activation by one step), as close to the float model's, and a chain gives the bits of one-token
    steps (row-invariant)."""
    if not avx512.layer_ready(torch.float32):
        pytest.skip("no whole-layer kernel here")
    model = smollm2_blocks
    ids = torch.tensor(model.tokenizer("The capital of France is Paris. The capital of Italy is Rome, and")["input_ids"])
    chunks = [ids[:8], ids[8:9], ids[9:]]
    with whole_layer_calls() as calls:
        fused = forwards(model, chunks, True)
    assert [(len(specs), tokens) for specs, tokens in calls] == [(model.num_layers, len(chunk)) for chunk in chunks]
    lean = forwards(model, chunks, False)
    floats = forwards(cats.load_model(SMOLLM2, kernels="aten"), chunks, False)
    for a, b, reference in zip(fused, lean, floats):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        # both are the float model up to 8-bit activations, whose steps the small model amplifies: as close to it
        assert (a - reference).abs().max() < 1.5 * (b - reference).abs().max()
        assert (a - b).abs().max() < 0.1 * b.abs().max()
    singles = forwards(model, [ids[:8]] + [ids[i:i + 1] for i in range(8, len(ids))], True)
    assert torch.equal(torch.cat(fused[1:]), torch.cat(singles[1:]))


@needs(STORIES_GGUF)
@needs(STORIES_HF)
def test_llama_rows_are_put_back_in_transformers_order():
    """stories260K is F32 and Llama-family (q and k rows reordered by llama.cpp's converter): on its blocks it must
    compute the HF folder's model up to summation order."""
    with pytest.warns(UserWarning, match="tokenizer"):
        blocks = cats.load_model(STORIES_GGUF)
    reference = cats.load_model(STORIES_HF)
    assert blocks.weight_format == "GGUF F32"
    ids = torch.arange(1, 40)
    with torch.no_grad():
        torch.testing.assert_close(blocks.forward(ids, blocks.new_cache()),
                                   reference.forward(ids, reference.new_cache()), rtol=1e-4, atol=1e-4)


@needs(SMOLLM2)
def test_float_settings_run_the_float_path_with_a_notice(capsys):
    model = cats.load_model(SMOLLM2, dtype="bfloat16")
    assert model.weight_format == "bfloat16" and model.kernel_path == "aten"
    assert "as --kernels aten" in capsys.readouterr().err
    with pytest.raises(InvalidArgumentError, match="kernels must be"):
        cats.load_model(SMOLLM2, kernels="fast")


@needs(SMOLLM2)
def test_without_kernels_the_float_path_runs_with_a_notice(monkeypatch, capsys):
    monkeypatch.setattr(quantized, "unavailable", lambda: "no C compiler found")
    model = cats.load_model(SMOLLM2)
    assert model.kernel_path == "aten" and model.weight_format == "float32"
    assert "no C compiler found" in capsys.readouterr().err


@needs(SMOLLM2)
def test_a_type_without_kernel_falls_back(monkeypatch, capsys):
    monkeypatch.setattr(quantized, "supports", lambda code, columns: code != quantized.TYPES["Q4_1"])
    model = cats.load_model(SMOLLM2)
    assert model.kernel_path == "aten"
    assert "is Q4_1 with rows of" in capsys.readouterr().err


@needs(SMOLLM2)
@pytest.mark.parametrize("isa", list(quantized.ISAS))
def test_speculation_reproduces_plain_decoding_on_each_kernel_path(smollm2_blocks, isa):
    if quantized.choose(isa)[0] is None:
        pytest.skip(f"the {isa} kernels do not run here")
    if avx512.unavailable(torch.float32) is not None:  # the row-invariant attention kernel
        pytest.skip(f"AVX-512 attention kernel: {avx512.unavailable(torch.float32)}")
    quantized.use(isa)
    try:
        prompt = encode_prompt(smollm2_blocks, "List three uses of a paperclip.", chat=True)
        plain = Generator(smollm2_blocks).generate(prompt, GenerationConfig(max_new_tokens=32)).token_ids
        recycle = TokenRecyclingDrafter(smollm2_blocks.vocab_size, total_tokens=80, depth=8)  # verifications of
        # up to 81 tokens: beyond the kernels' 64 queries a call, so run in chunks
        sizes = proposal_sizes(recycle)
        for drafter in (PromptLookupDrafter(num_tokens=6), TreeDrafter(smollm2_blocks, layer=8, tree_topk=3,
                                                                        total_tokens=9, depth=3), recycle):
            speculative = Generator(smollm2_blocks, drafter).generate(prompt, GenerationConfig(max_new_tokens=32))
            assert speculative.token_ids == plain, (isa, type(drafter).__name__)
        assert max(sizes) > avx512.ATTENTION_QUERY_LIMIT
    finally:
        quantized.use(None)


@needs(SMOLLM2)
@torch.no_grad()
def test_a_forward_of_more_tokens_than_a_kernel_call_takes_gives_each_what_decoding_gives_it(smollm2_blocks):
    """70 tokens in one forward (chunks of 64 queries on the whole-layer kernel) against the same tokens decoded one
    at a time: bit for bit, so a large verification reproduces plain decoding."""
    if avx512.unavailable(torch.float32) is not None:
        pytest.skip(f"AVX-512 attention kernel: {avx512.unavailable(torch.float32)}")
    ids = torch.randint(3, smollm2_blocks.vocab_size, (75,), generator=torch.Generator().manual_seed(0))
    cache = smollm2_blocks.new_cache()
    smollm2_blocks.forward(ids[:5], cache)
    together = smollm2_blocks.forward(ids[5:], cache)
    cache = smollm2_blocks.new_cache()
    smollm2_blocks.forward(ids[:5], cache)
    alone = torch.cat([smollm2_blocks.forward(ids[i:i + 1], cache) for i in range(5, 75)])
    assert together.shape[0] > avx512.ATTENTION_QUERY_LIMIT and torch.equal(together, alone)


@needs(SMOLLM2)
@torch.no_grad()
def test_a_draft_vocabulary_reads_out_through_the_heads_own_blocks(smollm2_blocks):
    """A reduced draft vocabulary on a GGUF head keeps its rows' blocks (not float32 rows): its logits are the whole
    head's at those token ids, bit for bit, and the plan prices the rows at the head's row bytes."""
    from cats.model.eagle3 import new_eagle3_head
    from cats.model.weights.budget import PartSizes

    model = smollm2_blocks
    vocab = torch.randperm(model.vocab_size, generator=torch.Generator().manual_seed(0))[:300].tolist()
    head = new_eagle3_head(model, [2, 15, 27], heads=3, kv_heads=1, intermediate_size=64, vocab_subset=vocab).eval()
    normed = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    logits = head.logits(normed)
    lm_head = model.hf_model.lm_head
    rows = head._head_rows.linear
    assert isinstance(rows, GGUFLinear) and rows.type_code == lm_head.type_code
    assert rows.blocks.shape == (300, lm_head.blocks.shape[1])
    assert not any("_head_rows" in name for name in head.state_dict())  # the target's rows: never saved
    assert torch.equal(logits, lm_head(head.norm(normed))[:, vocab])
    assert PartSizes.of(model.hf_model).head_row_bytes == lm_head.blocks.shape[1]


@needs(SMOLLM2)
@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_trained_adapter_computes_on_the_kernels_as_its_file_stores_it(smollm2_blocks, tmp_path, dtype):
    """On a model on GGUF blocks a loaded adapter's linears are kernel linears over its file's own values (bfloat16:
    half the bytes of float32 copies); its states are the float linears' up to float32 summation order, and it
    holds exactly the bytes the memory plan prices."""
    model = smollm2_blocks
    new_adapter(model, "draft", 4, block="attention").save(tmp_path / "draft", dtype=dtype)
    on_blocks = load_adapter(tmp_path / "draft", model)
    as_floats = load_adapter(tmp_path / "draft", model, on_blocks=False)
    linears = [m for m in on_blocks.modules() if isinstance(m, GGUFLinear)]
    assert len(linears) == 4 and {m.type_code for m in linears} == {STORED_FLOAT_TYPES[dtype]}
    assert not any(isinstance(m, nn.Linear) for m in on_blocks.modules())
    held = sum(p.numel() * p.element_size() for p in on_blocks.parameters())
    assert held == HeldAs(4, stored_matrices=True).bytes_of(tmp_path / "draft" / "model.safetensors")
    assert held < sum(p.numel() * p.element_size() for p in as_floats.parameters()) or dtype == torch.float32
    hidden = torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    one = [adapter(hidden[:, :1], model.new_cache(extra_layers=1)) for adapter in (on_blocks, as_floats)]
    torch.testing.assert_close(one[0], one[1], rtol=1e-4, atol=1e-4)  # one token: the kernels, float32 inputs
    five = [adapter(hidden, model.new_cache(extra_layers=1)) for adapter in (on_blocks, as_floats)]
    close = 1e-4 if dtype == torch.float32 else 5e-2  # more: torch in the stored dtype, inputs rounded to it
    torch.testing.assert_close(five[0], five[1], rtol=close, atol=close)


def test_stored_linears_multiply_the_weights_values_as_they_are():
    """`stored_linears` keeps each float weight's bytes as rows (no copy) and multiplies its values, for F32, F16 and
    BF16: one token on the kernels (the float linear's outputs up to summation order), more on torch in the stored
    dtype (the float linear's outputs on inputs rounded to it)."""
    for dtype in STORED_FLOAT_TYPES:
        holder = nn.Sequential(nn.Linear(64, 24, bias=True)).to(dtype).requires_grad_(False)
        weight, bias = holder[0].weight, holder[0].bias
        hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
        expected_one = nn.functional.linear(hidden[:1], weight.float(), bias.float())
        expected = nn.functional.linear(hidden.to(dtype), weight, bias).float()
        assert stored_linears(holder) == 1 and isinstance(holder[0], StoredLinear)
        assert holder[0].blocks.data_ptr() == weight.data_ptr()
        torch.testing.assert_close(holder[0](hidden[:1]), expected_one, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(holder[0](hidden), expected, rtol=1e-5, atol=1e-5)


def test_a_streamed_layer_dequantises_to_meta_linears_for_an_adapter_to_fill():
    """Under a memory budget a streamed layer holds meta blocks: an adapter copied from it gets meta float linears
    of the same shapes (its own weights are then assigned), not an error reading blocks that are not there."""
    from torch import nn

    from cats.model.kernels.gguf_modules import GGUFLinear, dequantize_linears

    Q8_0, columns, rows = 8, 64, 3  # Q8_0: 34 bytes per 32 values
    holder = nn.Sequential(GGUFLinear(torch.empty(rows, 2 * 34, dtype=torch.uint8, device="meta"), Q8_0, columns,
                                      bias=torch.zeros(rows)))
    dequantize_linears(holder)
    assert isinstance(holder[0], nn.Linear) and holder[0].weight.is_meta
    assert tuple(holder[0].weight.shape) == (rows, columns) and holder[0].bias is not None


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "phi3"])
def test_shared_name_maps_give_transformers_own_mapping(family):
    """`shared_name_maps`: the GGUF -> module name mapping equals transformers' own, gguf-py's map is built once per
    (architecture, blocks) inside the block, and gguf-py's function is back in place after it."""
    hf_model = AutoModelForCausalLM.from_config(tiny_config(family))
    processor = TENSOR_PROCESSORS.get(hf_model.config.model_type, TensorProcessor)(config=hf_model.config.to_dict())
    original = gguf.get_tensor_name_map
    expected = get_gguf_hf_weights_map(hf_model, processor)
    with shared_name_maps():
        assert get_gguf_hf_weights_map(hf_model, processor) == expected
        arch = next(iter(gguf.MODEL_ARCH_NAMES))
        assert gguf.get_tensor_name_map(arch, 4) is gguf.get_tensor_name_map(arch, 4)
    assert gguf.get_tensor_name_map is original
    assert set(expected.values()) == set(hf_model.state_dict())  # every parameter has its GGUF tensor
