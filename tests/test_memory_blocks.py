"""A GGUF model's decoder layers streamed in the file's own quantised blocks (cats.model.weights.blocks): the decoder gives
gguf-py's values bit for bit, the store keeps blocks only where they decode to the checkpoint's weights, and a model
streamed from such a store decodes exactly as the model in memory."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cats.config import GenerationConfig
from cats.loop.generator import Generator
from cats.model.weights import blocks
from cats.model.weights.blocks import GGUFBlocks
from cats.model.weights.budget import MemoryNeeds
from cats.model.weights.offload import _stored_estimate, plan_for
from cats.model.weights.parts import StoreError
from cats.model import load_model
from tests.conftest import hf_greedy, needs, tiny_model

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(blocks.unavailable() is not None, reason=f"no block decoder: {blocks.unavailable()}")

TYPES = {kind: gguf.GGMLQuantizationType[kind.upper()] for kind in blocks.KINDS}
HALVES = {"q4_0": (0,), "q8_0": (0,), "q5_0": (0,), "q4_1": (0, 2), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2),
          "q6_k": (208,)}  # byte offsets of each block's float16 scales
NEEDS = MemoryNeeds(context_tokens=64, min_resident_layers=1, max_tree_tokens=17, prefetch=1)
PROMPT = [5, 7, 9, 11, 13, 17]
SMOLLM2 = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "smollm2-135m-instruct-gguf"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CATS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def random_blocks(kind: str, rows: int, values: int, seed: int = 0) -> np.ndarray:
    """Random blocks with finite float16 scales (zeros and subnormals among them), ``[rows, bytes a row]``."""
    rng = np.random.default_rng(seed)
    _, size, per_block = blocks.KINDS[kind]
    raw = rng.integers(0, 256, size=(rows * values // per_block, size), dtype=np.uint8)
    for offset in HALVES[kind]:
        scales = rng.standard_normal(raw.shape[0]).astype(np.float16)
        scales[0], scales[1] = 0.0, np.float16(3e-6)  # a zero and a subnormal scale
        raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(blocks.KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_gives_gguf_py_values_bit_for_bit(kind, dtype):
    raw = random_blocks(kind, 6, 512)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, TYPES[kind]).copy()).to(dtype)
    decoded = blocks.decode(kind, torch.from_numpy(raw.copy()), expected.shape, dtype)
    assert torch.equal(decoded.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_decoder_refuses_mismatched_sizes():
    raw = torch.from_numpy(random_blocks("q8_0", 2, 64))
    with pytest.raises(ValueError, match="do not decode to"):
        blocks.decode_into("q8_0", raw.reshape(-1), torch.empty(100))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        blocks.decode_into("q8_0", raw.reshape(-1), torch.empty(128, dtype=torch.float64))


LINEARS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}


def quantised_checkpoint(folder: Path, perturbed: str = "model.layers.0.self_attn.v_proj.weight"):
    """A tiny float32 Llama whose linears are what quantised blocks decode to (Q4_1, Q8_0 and Q4_0 by layer),
    saved as a checkpoint with a GGUF file holding those blocks and the ``cats-source.json`` that names it, as
    `cats.model.source.convert_gguf` leaves it. In the checkpoint, q_proj's rows are reversed against the file's (as
    transformers permutes Llama's q/k rows) and one value of ``perturbed`` is one unit off its blocks' value."""
    model = tiny_model("llama", dtype=torch.float32)
    writer = gguf.GGUFWriter(str(folder / "tiny.gguf"), "llama")
    kinds = ["q4_1", "q8_0", "q4_0", "q4_1"]
    with torch.no_grad():
        for index, layer in enumerate(model.layers):
            kind = kinds[index]
            for name, short in LINEARS.items():
                weight = layer.get_submodule(name).weight
                raw = gguf.quants.quantize(weight.numpy(), TYPES[kind])
                writer.add_tensor(f"blk.{index}.{short}.weight", raw, raw_dtype=TYPES[kind])
                values = torch.from_numpy(gguf.quants.dequantize(raw, TYPES[kind]).copy())
                weight.copy_(values.flip(0) if name == "self_attn.q_proj" else values)
        value = model.hf_model.get_parameter(perturbed)
        value.view(-1)[3] = torch.nextafter(value.view(-1)[3], torch.tensor(float("inf")))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.hf_model.save_pretrained(folder)
    (folder / "cats-source.json").write_text(json.dumps({"gguf": str(folder / "tiny.gguf")}))
    return model


def budget_of(model, folder: Path) -> int:
    """The budget that keeps layer 0 resident and streams the rest (its blocks through the read buffer)."""
    stored = _stored_estimate(model.hf_model, GGUFBlocks(folder / "tiny.gguf"))
    return plan_for(model.hf_model, 1 << 40, NEEDS, stored_layers=stored).with_resident(1).planned_bytes


def test_store_keeps_blocks_that_decode_to_the_checkpoint_and_streams_them_losslessly(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    model = quantised_checkpoint(folder)
    loaded = load_model(folder, dtype="float32", memory_budget=budget_of(model, folder), memory_needs=NEEDS)
    store, plan = loaded.weights.store, loaded.memory_plan
    coded = {part: info.get("coded", {}) for part, info in store.meta["parts"].items()}
    assert {name: info["kind"] for name, info in coded["layer-001"].items()} == {
        f"{name}.weight": "q8_0" for name in LINEARS}
    assert sorted(coded["layer-000"]) == sorted(f"{name}.weight" for name in LINEARS if name != "self_attn.v_proj")
    assert not coded["embed"] and not coded["norm"]
    for index, layer in enumerate(model.layers):  # every part decodes to the checkpoint's bits
        for name, tensor in store.read(f"layer-{index:03d}").items():
            assert torch.equal(tensor.view(torch.int32), layer.get_parameter(name).view(torch.int32)), name
    assert plan.coded_layers == 3 and plan.read_buffer_bytes > 0
    assert plan.bytes_per_pass == sum(store.stored_layer_bytes()[1:]) < sum(plan.parts.layers[1:]) / 2
    assert "stored as the GGUF file's quantised blocks" in plan.describe()
    assert loaded.weights.pool_bytes <= plan.pool_bytes
    out = Generator(loaded).generate(PROMPT, GenerationConfig(max_new_tokens=12))
    assert out.token_ids == hf_greedy(model, PROMPT, 12)
    offload = out.stats.offload
    assert offload["bytes_read"] < offload["layers_read"] * max(plan.parts.layers) / 3  # blocks were read
    assert 0 < offload["decode_s"] <= offload["read_s"]
    loaded.close()


def test_blocks_in_bfloat16(tmp_path):
    from cats.model.weights.offload import build_skeleton, checkpoint_store

    folder = tmp_path / "model"
    folder.mkdir()
    model = quantised_checkpoint(folder)
    reference = model.hf_model.to(torch.bfloat16)  # the checkpoint's float32 values rounded as torch rounds them
    store = checkpoint_store(folder, build_skeleton(reference.config, torch.bfloat16), torch.bfloat16,
                             blocks=GGUFBlocks.of_checkpoint(folder, torch.bfloat16))
    assert all(store.meta["parts"][f"layer-{i:03d}"].get("coded") for i in range(4))
    for index, layer in enumerate(reference.model.layers):
        for name, tensor in store.read(f"layer-{index:03d}").items():
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor.view(torch.int16), layer.get_parameter(name).view(torch.int16)), name


def test_without_the_decoder_a_store_is_plain_and_a_store_of_blocks_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    model = quantised_checkpoint(folder)
    explicit = tmp_path / "store"
    load_model(folder, dtype="float32", memory_budget=budget_of(model, folder), memory_needs=NEEDS,
               layer_store=explicit).close()
    monkeypatch.setattr(blocks, "_STATE", {"library": None, "reason": "no C compiler found"})
    assert GGUFBlocks.of_checkpoint(folder, torch.float32) is None
    with pytest.raises(StoreError, match="keeps layers in quantised blocks, but the block decoder is unavailable "
                                         r"\(no C compiler found\); delete .* to rebuild"):
        load_model(folder, dtype="float32", memory_budget=budget_of(model, folder), memory_needs=NEEDS, layer_store=explicit)
    plain = load_model(folder, dtype="float32", memory_budget=budget_of(model, folder), memory_needs=NEEDS)
    assert plain.memory_plan.coded_layers == 0 and plain.memory_plan.read_buffer_bytes == 0
    assert Generator(plain).generate(PROMPT, GenerationConfig(max_new_tokens=8)).token_ids == hf_greedy(model, PROMPT, 8)
    plain.close()


@needs(SMOLLM2)
@pytest.mark.parametrize("method", ["ar", "tree"])
def test_smollm2_streams_its_q4_1_blocks_and_decodes_as_in_memory(method, monkeypatch):
    import cats

    monkeypatch.delenv("CATS_CACHE")  # the converted checkpoint other tests use
    adapters = None if method == "ar" else str(Path(__file__).resolve().parents[1] / "adapters" / "smollm2-135m-instruct")
    prompt = "Name three colours of the rainbow."
    float_path = cats.KernelConfig(kernels="aten")  # the file dequantised; its blocks stream from the layer store
    streamed = cats.generate(str(SMOLLM2), prompt, method=method, chat=True, memory=cats.MemoryConfig(budget="50%"),
                             generation=GenerationConfig(max_new_tokens=24), drafting=cats.DraftConfig(adapters=adapters),
                             kernels=float_path)
    plain = cats.generate(str(SMOLLM2), prompt, method="ar", chat=True, generation=GenerationConfig(max_new_tokens=24),
                          kernels=float_path)
    assert streamed.token_ids == plain.token_ids
    offload = streamed.stats.offload
    per_layer = offload["bytes_read"] / offload["layers_read"]
    assert per_layer < 2.3 * 2**20  # Q4_1 blocks and two norms, not 13.5 MiB of float32


def test_the_gguf_index_is_kept_beside_the_checkpoint(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    quantised_checkpoint(folder)
    first = GGUFBlocks.of_checkpoint(folder, torch.float32)
    assert (folder / "cats-blocks.json").is_file() and sorted(first.layers) == [0, 1, 2, 3]

    def no_parse(path):
        raise AssertionError("the file was parsed again")

    monkeypatch.setattr(GGUFBlocks, "_index", staticmethod(no_parse))
    assert GGUFBlocks.of_checkpoint(folder, torch.float32).layers == first.layers
    (folder / "cats-blocks.json").write_text("{damaged")
    with pytest.raises(AssertionError, match="parsed again"):  # a damaged index is rebuilt from the file
        GGUFBlocks.of_checkpoint(folder, torch.float32)
    assert GGUFBlocks.of_checkpoint(folder, torch.float64) is None  # blocks decode to float32 and bfloat16 only


def test_block_reads_ahead_survive_passes_out_of_order(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    model = quantised_checkpoint(folder)
    loaded = load_model(folder, dtype="float32", memory_budget=budget_of(model, folder), memory_needs=NEEDS)
    assert loaded.memory_plan.streamed == (1, 2, 3) and loaded.memory_plan.coded_layers == 3
    hidden = torch.randn(1, 5, 64)
    expected = model.forward_layers(hidden, 0, 4, model.new_cache())
    for stop in (2, 3, 1, 2):  # a pass abandoned at layer `stop`: the blocks read ahead for the next are dropped
        loaded.forward_layers(hidden, 0, stop, loaded.new_cache())
        assert torch.equal(loaded.forward_layers(hidden, 0, 4, loaded.new_cache()), expected)
    counters = loaded.weights.snapshot()
    assert counters.out_of_order >= 2 and counters.decode_s > 0
    loaded.close()
    assert loaded.weights.block_reader._shutdown


def test_a_tight_budget_reads_blocks_through_one_buffer(tmp_path):
    import dataclasses

    folder = tmp_path / "model"
    folder.mkdir()
    model = quantised_checkpoint(folder)
    stored = _stored_estimate(model.hf_model, GGUFBlocks(folder / "tiny.gguf"))
    floor = dataclasses.replace(NEEDS, min_resident_layers=1)
    two = plan_for(model.hf_model, 1 << 40, floor, stored_layers=stored).with_resident(1)
    one = dataclasses.replace(two, read_buffers=1)
    assert two.read_buffers == 2 and one.planned_bytes == two.planned_bytes - two.read_buffer_bytes // 2
    loaded = load_model(folder, dtype="float32", memory_budget=one.planned_bytes, memory_needs=floor)
    assert loaded.memory_plan.read_buffers == 1 and loaded.memory_plan.resident_layers == 1
    assert "block read buffers (1 x" in loaded.memory_plan.describe()
    assert loaded.weights.block_reader is None and len(loaded.weights.read_buffers) == 1
    out = Generator(loaded).generate(PROMPT, GenerationConfig(max_new_tokens=12))
    assert out.token_ids == hf_greedy(model, PROMPT, 12)
    loaded.close()


def test_a_streamed_tensor_that_stays_plain_is_planned_with_its_real_size(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    model = quantised_checkpoint(folder, perturbed="model.layers.2.self_attn.v_proj.weight")
    estimate = _stored_estimate(model.hf_model, GGUFBlocks(folder / "tiny.gguf"))
    loaded = load_model(folder, dtype="float32", memory_budget=budget_of(model, folder), memory_needs=NEEDS)
    plan, store = loaded.memory_plan, loaded.weights.store
    assert "self_attn.v_proj.weight" not in store.meta["parts"]["layer-002"]["coded"]
    assert store.stored_layer_bytes()[2] > estimate[2]  # the estimate counted its blocks
    assert plan.parts.stored_layers == store.stored_layer_bytes()  # planned again with what the store holds
    assert plan.bytes_per_pass == sum(store.stored_layer_bytes()[plan.resident_layers:])
    assert loaded.weights.pool_bytes <= plan.pool_bytes and plan.planned_bytes <= plan.budget
    assert Generator(loaded).generate(PROMPT, GenerationConfig(max_new_tokens=8)).token_ids == hf_greedy(model, PROMPT, 8)
    loaded.close()


def test_a_decoded_layer_takes_the_bytes_of_the_plain_layer(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    model = quantised_checkpoint(folder)
    loaded = load_model(folder, dtype="float32", memory_budget=budget_of(model, folder), memory_needs=NEEDS)
    for i in loaded.memory_plan.streamed:  # a stream buffer the plan sized for the plain layer holds it decoded
        assert loaded.weights.layouts[i].data_bytes == loaded.memory_plan.parts.layers[i]
    assert all(len(slot.memory) == loaded.memory_plan.slot_bytes for slot in loaded.weights.slots)
    loaded.close()
