"""CATS's own Llama-family decoder (`cats.model.decoder`) against transformers' classes: the same module names, the
same outputs bit for bit, and no transformers modeling code imported where it is used."""

import copy
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from cats.draft.layer_skip.drafter import SkipModel, SkipSet
from cats.model.decoder import DecoderForCausalLM, skeleton, unsupported
from cats.model.layered import LayeredModel
from cats.tree import verification_inputs
from conftest import COMMON, SMOLLM2, needs, tiny_config

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def config_of(family: str):
    if family == "llama-biases-llama3":  # every bias transformers' Llama can have, and a scaled rotary embedding
        return LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3_ROPE)
    return tiny_config(family)


def twins(family: str, implementation: str = "sdpa"):
    """transformers' model of ``family`` (random weights) and the decoder's with the same state dict, loaded strict:
    transformers' names, tensor for tensor."""
    config = config_of(family)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32,
                                                 attn_implementation=implementation)
    ours = DecoderForCausalLM(copy.deepcopy(config), implementation)
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours


def run(model: LayeredModel, prompt: torch.Tensor, nodes: torch.Tensor, parents: torch.Tensor):
    """Logits of a prompt, then of a token tree after it (a tree mask), and the states after layer 2 of both."""
    cache = model.new_cache()
    first = model.forward(prompt, cache)
    positions, attend = verification_inputs(parents, prompt.numel())
    second = model.forward(torch.cat([prompt[-1:], nodes]), cache, positions, attend)
    return first, second, cache.hf_cache.layers[2].keys


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "llama-biases-llama3", "mistral", "mistral-swa", "qwen2"])
def test_the_decoder_computes_what_transformers_classes_compute_bit_for_bit(family, implementation):
    assert unsupported(config_of(family)) is None
    reference, ours = (model.eval() for model in twins(family, implementation))
    prompt = torch.randint(3, COMMON["vocab_size"], (19,), generator=torch.Generator().manual_seed(1))
    nodes, parents = torch.tensor([5, 9, 7, 11, 13]), torch.tensor([-1, -1, 0, 2, 1])
    for lean in (False, True):  # the modules' own forward, then the lean forward on their parameters
        outputs = []
        for hf_model in (reference, ours):
            model = LayeredModel(hf_model, name=family)
            model.lean = lean
            with torch.no_grad():
                outputs.append(run(model, prompt, nodes, parents))
        for theirs, mine in zip(*outputs):
            assert torch.equal(theirs, mine), (family, implementation, lean)


def test_layer_skipping_splits_its_layers_as_transformers_layers():
    """Layer skipping calls the attention and the MLP of a layer on their own, with transformers' keywords."""
    reference, ours = (model.eval() for model in twins("qwen2"))
    skip = SkipSet(attention=(1,), mlp=(2,))
    tokens = torch.tensor([3, 17, 5, 40, 8, 9])
    outputs = []
    for hf_model in (reference, ours):
        model = LayeredModel(hf_model, name="qwen2")
        with torch.no_grad():
            outputs.append(SkipModel(model, skip).forward(tokens, model.new_cache(), torch.arange(6)))
    assert torch.equal(*outputs)


def test_its_rotary_embedding_and_training_forward_are_transformers_own():
    reference, ours = (model.train() for model in twins("llama-biases-llama3"))
    positions = torch.arange(40).unsqueeze(0)
    hidden = torch.randn(2, 40, COMMON["hidden_size"])
    for theirs, mine in zip(reference.model.rotary_emb(hidden, positions), ours.model.rotary_emb(hidden, positions)):
        assert torch.equal(theirs, mine)
    rotary = ours.model.rotary_emb(hidden, positions)
    mask = torch.full((40, 40), torch.finfo(torch.float32).min).triu(1)[None, None]
    grads = []
    for hf_model in (reference, ours):  # an adapter trains a copy of a layer through its module forward
        layer = hf_model.model.layers[1]
        layer(hidden, attention_mask=mask, position_embeddings=rotary).pow(2).mean().backward()
        grads.append([parameter.grad for parameter in layer.parameters()])
    for theirs, mine in zip(*grads):
        assert torch.equal(theirs, mine)


@pytest.mark.parametrize("family", ["qwen2-swa", "qwen3", "gemma3", "phi3"])
def test_other_families_keep_transformers_classes(family):
    config = config_of(family)
    assert unsupported(config) is not None
    assert type(skeleton(config)).__module__.startswith("transformers.")


def test_a_rotary_embedding_that_changes_per_forward_keeps_transformers_classes():
    config = LlamaConfig(**COMMON, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    assert "dynamic" in unsupported(config)


def in_fresh_process(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_cats_and_the_skeleton_of_a_qwen2_file_import_no_transformers_modeling_code():
    """transformers' modeling code (``modeling_utils`` and the model-loading code behind it) costs ~130 MiB of
    process memory and 2.5 s, accelerate 13 MiB (boto3 among its imports): a memory budget spends them on layers
    instead. The skeleton's parameters are meta, its rotary frequencies real."""
    out = in_fresh_process(
        "import sys, cats.cli\n"
        "from transformers import AutoConfig\n"
        "from cats.model.decoder import skeleton\n"
        "config = AutoConfig.for_model('qwen2', vocab_size=96, hidden_size=64, intermediate_size=96, "
        "num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)\n"
        "model = skeleton(config)\n"
        "print(type(model).__name__, all(p.is_meta for p in model.parameters()), "
        "model.model.rotary_emb.inv_freq.device.type, float(model.model.rotary_emb.inv_freq[1]))\n"
        "print(sorted(m for m in ('transformers.modeling_utils', 'transformers.core_model_loading', 'torch._dynamo', "
        "'scipy', 'accelerate', 'boto3') if m in sys.modules))\n")
    # inv_freq[1] = 1 / theta ** (2 / head_dim): theta 10000 (the config's default), head_dim 16
    name, meta, device, frequency, imported = out.split()
    assert (name, meta, device, imported) == ("DecoderForCausalLM", "True", "cpu", "[]")
    assert float(frequency) == pytest.approx(1.0 / 10000 ** (2 / 16), rel=1e-6)


@needs(SMOLLM2)
def test_a_gguf_file_on_its_blocks_decodes_without_transformers_modeling_code():
    out = in_fresh_process(
        "import sys, cats\n"
        f"model = cats.load({str(SMOLLM2)!r})\n"
        "result = cats.generate(model, 'Hi', method='pld', chat=True, "
        "generation=cats.GenerationConfig(max_new_tokens=8))\n"
        "print(type(model.hf_model).__name__, len(result.token_ids), 'transformers.modeling_utils' in sys.modules)\n")
    assert out.split() == ["DecoderForCausalLM", "8", "False"]
