"""Shared fixtures: tiny random models of every supported family (no download) and the ../shared data."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from cats.model import LayeredModel
from cats.model.kernels import avx512

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("CATS_SHARED", REPO_ROOT.parent / "shared"))
SHARED_DATA = SHARED / "data"
STORIES_HF = SHARED_DATA / "stories260k-gguf" / "hf"
STORIES_GGUF = SHARED_DATA / "stories260k-gguf" / "stories260K.gguf"
SMOLLM2 = SHARED_DATA / "smollm2-135m-instruct-gguf"
MT_BENCH = SHARED_DATA / "mt_bench" / "question.jsonl"

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              initializer_range=0.2)


def tiny_config(family: str):
    """A 4-layer config of ``family``; families ending in ``-swa`` use a 12-token sliding window."""
    from transformers import (Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config)

    if family == "llama":
        return LlamaConfig(**COMMON)
    if family == "mistral":
        return MistralConfig(**COMMON, sliding_window=None)
    if family == "mistral-swa":
        return MistralConfig(**COMMON, sliding_window=12)
    if family == "qwen2":
        return Qwen2Config(**COMMON)
    if family == "qwen2-swa":  # sliding window on the upper layers only (max_window_layers)
        return Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=12, max_window_layers=2)
    if family == "qwen3":
        return Qwen3Config(**COMMON, head_dim=16)
    if family == "gemma3":
        return Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=12, query_pre_attn_scalar=16,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                                final_logit_softcapping=30.0)
    if family == "phi3":
        return Phi3Config(**COMMON, sliding_window=None)
    raise ValueError(family)


FAMILIES = ["llama", "mistral", "mistral-swa", "qwen2", "qwen2-swa", "qwen3", "gemma3", "phi3"]


def tiny_model(family: str, seed: int = 0, damp: float | None = None, dtype=torch.float64) -> LayeredModel:
    """Random tiny model. ``damp`` scales the output projections of layers >= 1 so that shallow exits often
    agree with the full model (a stand-in for a trained early-exit model; exercises partial acceptance)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if damp is not None:
        with torch.no_grad():
            for layer in hf_model.model.layers[1:]:
                layer.self_attn.o_proj.weight.mul_(damp)
                layer.mlp.down_proj.weight.mul_(damp)
    return LayeredModel(hf_model.eval(), tokenizer=None, name=f"tiny-{family}")


@pytest.fixture(scope="session", params=FAMILIES)
def family_model(request) -> LayeredModel:
    return tiny_model(request.param)


def needs(path: Path):
    return pytest.mark.skipif(not path.exists(), reason=f"{path} not present (../shared data missing)")


def hf_greedy(model: LayeredModel, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding: the reference every CATS method must reproduce."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      do_sample=False, num_beams=1, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def proposal_sizes(drafter) -> list[int]:
    """The token count of every proposal ``drafter`` makes from now on (its ``propose`` wrapped in place)."""
    sizes, propose = [], drafter.propose

    def recorded(state, max_tokens):
        proposal = propose(state, max_tokens)
        sizes.append(proposal.num_tokens)
        return proposal

    drafter.propose = recorded
    return sizes


def assert_drafters_reproduce_plain_decoding(model: LayeredModel, prompt_ids: list[int], max_new_tokens: int = 24):
    """Prompt lookup, early exit at layer 1 and a small dynamic tree each give plain greedy decoding's tokens."""
    from cats.draft import EarlyExitDrafter, PromptLookupDrafter, TreeDrafter
    from cats.config import GenerationConfig
    from cats.loop.generator import Generator

    def greedy(drafter=None):
        return Generator(model, drafter).generate(prompt_ids, GenerationConfig(max_new_tokens=max_new_tokens)).token_ids

    plain = greedy()
    for drafter in (PromptLookupDrafter(num_tokens=6), EarlyExitDrafter(model, layer=1, num_tokens=4),
                    TreeDrafter(model, layer=1, tree_topk=3, total_tokens=9, depth=3)):
        assert greedy(drafter) == plain, type(drafter).__name__


CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="session")
def stories_chat_dir(tmp_path_factory) -> Path:
    """stories260K as a model folder with a (plain) chat template, which the original lacks: for chat and server
    tests that need a real folder with a real tokenizer."""
    import shutil

    if not STORIES_HF.exists():
        pytest.skip(f"{STORIES_HF} not present (../shared data missing)")
    folder = tmp_path_factory.mktemp("stories-chat")
    for item in STORIES_HF.iterdir():
        shutil.copy(item, folder / item.name)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return folder


STORY_PROMPTS = ["Lily saw a big red ball.", "Tom and his dog went to the park.", "The sun was hot.",
                 "A little bird could not fly.", "Sam had a toy car.", "Mom made a cake.", "The cat sat on a mat.",
                 "Ben found a shiny rock."]
STORY_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}\n{% endfor %}"


def stories_for_training() -> LayeredModel:
    """stories260K in float32 with a plain chat template, one thread: the model of the training tests."""
    import cats

    torch.set_num_threads(1)
    model = cats.load_model(STORIES_HF, dtype="float32")
    model.tokenizer.chat_template = STORY_TEMPLATE
    return model


def stories_training_data(model: LayeredModel, folder: Path, layers: list[int]):
    """Sampled answers to `STORY_PROMPTS` (two each, 40 tokens), with the states after ``layers``."""
    import json

    from cats.train.data import DataConfig, make_training_data
    from cats.train.folder import TrainingData

    prompts = folder / "prompts.json"
    prompts.write_text(json.dumps([{"conversations": [{"from": "human", "value": p}]} for p in STORY_PROMPTS]))
    make_training_data(model, DataConfig(prompts=prompts, out=folder / "data", layers=layers, max_new_tokens=40,
                                         samples_per_prompt=2, temperature=1.0, top_k=8, batch_size=4,
                                         shard_prompts=4, progress=False))
    return TrainingData.open(folder / "data", model=model)


@contextmanager
def whole_layer_calls() -> Iterator[list[tuple[list, int]]]:
    """Every call of the whole-layer kernel meanwhile, ``(specs of the layers it ran, tokens)``: one spec from
    `avx512.layer`, the consecutive layers of a forward from `avx512.layers`."""
    calls, one, many = [], avx512.layer, avx512.layers

    def layer(spec, hidden, *rest):
        calls.append(([spec], hidden.shape[1]))
        return one(spec, hidden, *rest)

    def layers(specs, hidden, *rest):
        calls.append((list(specs), hidden.shape[1]))
        return many(specs, hidden, *rest)

    avx512.layer, avx512.layers = layer, layers
    try:
        yield calls
    finally:
        avx512.layer, avx512.layers = one, many
