"""A GGUF file on its own blocks under a memory budget: the deep layers stream from the file itself (its spans read
into the stream buffers, computed on as read), and every method decodes what the model in memory decodes."""

from __future__ import annotations

import ctypes

import pytest
import torch

import cats
from cats.api import prepare
from cats.config import GenerationConfig
from cats.draft import PromptLookupDrafter, TreeDrafter
from cats.errors import InvalidArgumentError
from cats.loop.generator import Generator
from cats.methods import make_drafter, memory_needs
from cats.model.kernels import avx512, quantized
from cats.model.kernels.gguf_modules import GGUFLinear
from cats.model.kernels.layer_forward import _layer_spec
from cats.model.identity import model_fingerprint
from cats.model.weights import BudgetTooSmallError, MemoryNeeds
from cats.model.weights.rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss, return_freed_memory
from cats.model.weights.stream_order import load_stream_order
from cats.model.weights.transient import (
    HIDDEN_COPIES,
    PROMPT_COPIES,
    activation_bytes,
    kv_cache_bytes,
    layer_scratch_bytes,
)
from cats.prompts import encode_prompt
from tests.conftest import SMOLLM2, STORIES_GGUF, needs, whole_layer_calls

pytestmark = pytest.mark.skipif(quantized.unavailable() is not None, reason=f"kernels: {quantized.unavailable()}")
SMOLLM2_FILE = SMOLLM2 / "SmolLM2-135M-Instruct.Q4_1.gguf"
NEEDS = dict(context_tokens=256, min_resident_layers=9)  # the tree drafts from layer 8


def layer_bytes(layer: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters())


@pytest.fixture(scope="module")
def in_memory():
    return cats.load_model(SMOLLM2)


@needs(SMOLLM2)
@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_streamed_blocks_decode_as_in_memory(in_memory, io):
    if avx512.unavailable(torch.float32) is not None:
        pytest.skip(f"AVX-512 attention kernel: {avx512.unavailable(torch.float32)}")
    model = cats.load_model(SMOLLM2, memory_budget="100MiB", memory_needs=MemoryNeeds(**NEEDS), offload_io=io)
    plan, streamer = model.memory_plan, model.weights
    assert model.kernel_path == in_memory.kernel_path and model.weight_format == in_memory.weight_format
    assert plan.resident_layers >= 9 and len(plan.streamed) > 0 and plan.coded_layers == 0  # nothing to decode
    assert streamer.store is None and streamer.store_files() == [SMOLLM2_FILE.resolve()]
    for i in plan.streamed:  # meta between uses; each layer one span of the file, its own bytes (aligned)
        assert all(p.is_meta for p in model.layers[i].parameters())
        span = streamer.layouts[i]
        assert span.data_start % 4096 == 0
        assert layer_bytes(in_memory.layers[i]) <= span.data_bytes <= layer_bytes(in_memory.layers[i]) + 4096
    texts = ("List three uses of a paperclip.", "Write a haiku about the sea.")
    for text in texts if io == "direct" else texts[:1]:  # buffered reads: the same bytes by another route
        prompt = encode_prompt(in_memory, text, chat=True)
        config = GenerationConfig(max_new_tokens=24)
        plain = Generator(in_memory).generate(prompt, config).token_ids
        before = streamer.snapshot()
        with whole_layer_calls() as calls:
            assert Generator(model).generate(prompt, config).token_ids == plain
        # each pass: the resident layers in one call, then each streamed layer in one of its own
        assert [len(specs) for specs, _ in calls] == ([plan.resident_layers] + [1] * len(plan.streamed)) * 24
        read = streamer.snapshot().minus(before)
        assert read.acquires == len(plan.streamed) * 24  # the prefill and 23 decode passes, each over every one
        assert read.layers_read >= read.acquires - plan.pool_slots  # each read, not held over from the last pass
        drafters = (PromptLookupDrafter(num_tokens=6), TreeDrafter(model, layer=8, tree_topk=3, total_tokens=9, depth=3))
        for drafter in drafters if io == "direct" else drafters[:1]:
            assert Generator(model, drafter).generate(prompt, config).token_ids == plain, type(drafter).__name__
    model.close()


@needs(SMOLLM2)
def test_a_model_in_memory_streams_from_its_file_in_place(in_memory):
    model = cats.load_model(SMOLLM2)
    prompt = encode_prompt(model, "Name three colours of the rainbow.", chat=True)
    plain = Generator(in_memory).generate(prompt, GenerationConfig(max_new_tokens=16)).token_ids
    memory = cats.MemoryConfig(budget="100MiB")
    with pytest.raises(InvalidArgumentError, match="no layer store"):
        prepare(model, "ar", None, cats.MemoryConfig(budget="100MiB", layer_store="/tmp/nowhere"),
                     context_tokens=256)
    prepare(model, "ar", None, memory, context_tokens=256)
    assert model.memory_plan.streamed and model.weights.store is None
    assert Generator(model).generate(prompt, GenerationConfig(max_new_tokens=16)).token_ids == plain
    model.close()


@needs(SMOLLM2)
def test_a_budget_below_the_minimum_names_it_before_reading():
    with pytest.raises(BudgetTooSmallError, match="minimum of"):
        cats.load_model(SMOLLM2, memory_budget="20MiB", memory_needs=MemoryNeeds(context_tokens=256))
    with pytest.raises(InvalidArgumentError, match="no layer store"):
        cats.load_model(SMOLLM2, memory_budget="100MiB", layer_store="/tmp/nowhere")


@needs(STORIES_GGUF)
def test_llama_rows_in_the_files_order_stream_too():
    """stories260K's q and k rows are in llama.cpp's order in the file: streamed as stored, outputs reordered."""
    with pytest.warns(UserWarning, match="tokenizer"):
        resident = cats.load_model(STORIES_GGUF)
    with pytest.warns(UserWarning, match="tokenizer"):
        model = cats.load_model(STORIES_GGUF, memory_budget="1.6MiB", memory_needs=MemoryNeeds(context_tokens=64))
    assert model.memory_plan.streamed
    reordered = [m for m in model.layers[model.memory_plan.resident_layers].modules()
                 if isinstance(m, GGUFLinear) and m.order is not None]
    assert len(reordered) == 2  # q and k
    ids = torch.arange(1, 40)
    with torch.no_grad():
        assert torch.equal(model.forward(ids, model.new_cache()), resident.forward(ids, resident.new_cache()))
    model.close()


@needs(STORIES_GGUF)
def test_a_prompt_planned_in_chunks_runs_in_chunks_and_decodes_as_a_whole_prompt():
    """A plan that prices the prompt in chunks (`MemoryNeeds.prompt_chunk`, set where the prompt's length is not
    known) runs it that many tokens a forward: one sweep of the streamed layers per chunk, and the tokens of the model
    in memory, which takes the prompt in one forward. The plan reserves the last chunk's activations, not the whole
    prompt's; a drafter that keeps the prompt's states (``prompt_captures``) gets the whole prompt priced and run."""
    with pytest.warns(UserWarning, match="tokenizer"):
        resident = cats.load_model(STORIES_GGUF)
    prompt = torch.randint(3, resident.vocab_size, (45,), generator=torch.Generator().manual_seed(4)).tolist()
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    plain = Generator(resident).generate(prompt, config).token_ids
    needs_of = dict(context_tokens=64, prompt_chunk=8, prompt_captures=False)
    with pytest.warns(UserWarning, match="tokenizer"):
        model = cats.load_model(STORIES_GGUF, memory_budget="1.3MiB", memory_needs=MemoryNeeds(**needs_of))
    streamed = len(model.memory_plan.streamed)
    assert streamed and "64-token prompt, 8 a forward" in model.memory_plan.describe()
    config_of, chunked = resident.config, model.memory_plan.activation_bytes  # the last chunk: 8 tokens after 56
    assert chunked in {max(activation_bytes(config_of, 4, 1, 64), activation_bytes(
        config_of, 4, 8, 56, logit_rows=1, fused=fused, captures=False)) for fused in (True, False)}
    result = Generator(model, PromptLookupDrafter(num_tokens=4)).generate(prompt, config)
    assert result.token_ids == plain
    chunks, passes = 6, result.stats.target_forwards - 1  # 45 tokens, 8 a forward; then the verification passes
    assert result.stats.offload["acquires"] == streamed * (chunks + passes)
    model.close()
    needs_of["prompt_captures"] = True  # an adapter's states of the prompt: the whole prompt, one forward
    with pytest.raises(BudgetTooSmallError, match="64-token prompt\\)"), pytest.warns(UserWarning, match="tokenizer"):
        cats.load_model(STORIES_GGUF, memory_budget="1.3MiB", memory_needs=MemoryNeeds(**needs_of))
    with pytest.warns(UserWarning, match="tokenizer"):
        model = cats.load_model(STORIES_GGUF, memory_budget="1.6MiB", memory_needs=MemoryNeeds(**needs_of))
    assert "64-token prompt)" in model.memory_plan.describe() and model.memory_plan.activation_bytes > chunked
    result = Generator(model).generate(prompt, config)
    assert result.token_ids == plain
    assert result.stats.offload["acquires"] == len(model.memory_plan.streamed) * result.stats.target_forwards
    model.close()


@needs(SMOLLM2)
def test_the_shipped_stream_order_streams_what_layer_skip_skips(in_memory, monkeypatch, tmp_path):
    """SmolLM2's GGUF under a budget for layer-skip and dytc: the first layers of its shipped stream order stream from
    the file (not the deepest), the drafts run the resident layers alone (one sweep of the streamed layers per
    verification pass), and both decode what the model in memory decodes."""
    monkeypatch.setenv("CATS_CACHE", str(tmp_path))  # the shipped order, not one calibrated here
    order = load_stream_order(model_fingerprint(in_memory), in_memory.num_layers)
    assert order is not None and 0 not in order.layers
    prompt = encode_prompt(in_memory, "List three uses of a paperclip.", chat=True)
    config = GenerationConfig(max_new_tokens=24)
    plain = Generator(in_memory).generate(prompt, config).token_ids
    for method in ("layer-skip", "dytc"):
        needs_of = memory_needs(in_memory.config, torch.float32, method, context_tokens=256, prefetch=1,
                                on_blocks=True)
        model = cats.load_model(SMOLLM2, memory_budget="90MiB", memory_needs=needs_of)
        plan = model.memory_plan
        assert len(plan.streamed) > 0 and plan.streamed == order.skipped(len(plan.streamed)), method
        drafter = make_drafter(method, model)
        result = Generator(model, drafter, method=method).generate(prompt, config)
        assert result.token_ids == plain, method
        counts = result.stats.offload
        assert counts["acquires"] == len(plan.streamed) * result.stats.target_forwards, method
        assert counts["streamed_layers"] == list(plan.streamed) and counts["out_of_order"] == 0
        model.close()


@needs(SMOLLM2)
def test_the_plan_prices_a_prompt_on_the_blocks_and_the_forwards_stay_within_it(in_memory, monkeypatch):
    """On GGUF blocks every forward runs on the whole-layer kernel, and the plan reserves a prompt's activations as
    that kernel holds them (`activation_bytes(fused=True)`: a 64-token scratch, hidden states and mask, not every
    query's scores and intermediates). What a 400-token prompt, and then 17-token verification passes, allocate (the
    process's high-water above its KV cache) stays within the plan's reservation. Without the lean forward
    (``CATS_LEAN=0``) the modules' estimate is reserved again."""
    if avx512.unavailable(torch.float32) is not None:
        pytest.skip(f"AVX-512 layer kernel: {avx512.unavailable(torch.float32)}")
    config, prompt_tokens, context = in_memory.config, 400, 448
    spec = _layer_spec(in_memory.layers[0], torch.float32)  # the kernel's own count of its scratch
    assert all(avx512._STATE["library"].cats_layer_scratch(ctypes.byref(spec), tokens)
               == layer_scratch_bytes(config, tokens) for tokens in (1, 17, 64))
    needs_of = dict(context_tokens=context, prompt_tokens=prompt_tokens, min_resident_layers=9, max_tree_tokens=17,
                    prompt_captures=False)  # prompt lookup keeps no layer's states of the prompt
    model = cats.load_model(SMOLLM2, memory_budget="100MiB", memory_needs=MemoryNeeds(**needs_of))
    plan = model.memory_plan
    passes = activation_bytes(config, 4, 17, context)
    prefill = activation_bytes(config, 4, prompt_tokens, 0, logit_rows=1, fused=True, captures=False)
    captured = activation_bytes(config, 4, prompt_tokens, 0, logit_rows=1, fused=True)  # a drafter keeping states
    assert captured - prefill == (HIDDEN_COPIES - PROMPT_COPIES) * prompt_tokens * config.hidden_size * 4
    modules = activation_bytes(config, 4, prompt_tokens, 0, logit_rows=1)
    assert plan.streamed and plan.activation_bytes == max(passes, prefill) < modules / 2
    repeated = torch.randint(3, in_memory.vocab_size, (50,), generator=torch.Generator().manual_seed(1)).tolist()
    prompt, drafter = repeated * (prompt_tokens // 50), PromptLookupDrafter(num_tokens=16)  # passes of 17 tokens
    kv = kv_cache_bytes(config, 4, context + 17)
    for new_tokens, reserved in ((1, prefill), (40, plan.activation_bytes)):
        config_of = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
        Generator(model, drafter).generate(prompt, config_of)  # its pages of the file and the kernel's scratch, once
        return_freed_memory()
        assert reset_peak_rss()
        before = current_rss_bytes()
        result = Generator(model, drafter).generate(prompt, config_of)
        assert peak_rss_bytes() - before - kv <= reserved, new_tokens
    assert max(result.stats.accept_lengths) > 2  # the passes held drafts, accepted
    model.close()
    monkeypatch.setenv("CATS_LEAN", "0")
    with pytest.raises(BudgetTooSmallError, match="activations"):  # the 20 MiB the prompt's plan saved
        cats.load_model(SMOLLM2, memory_budget="100MiB", memory_needs=MemoryNeeds(**needs_of))
    model = cats.load_model(SMOLLM2, memory_budget="120MiB", memory_needs=MemoryNeeds(**needs_of))
    assert model.memory_plan.activation_bytes == modules
    model.close()
