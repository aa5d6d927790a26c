"""``cats train data``: prompt files, the data folder format, teacher-forced states, resuming, and bad input.

The model is the tiny real stories260K Llama (5 layers) with a made-up chat template, loaded in float64 so that
batched generation and the layered forward agree exactly."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import cats
from cats.cli.train import add_data_parser
from cats.errors import InvalidArgumentError
from cats.train import data as train_data
from cats.train.data import DataConfig, make_training_data
from cats.train.folder import TrainingData
from cats.train.teacher import generate_answers, sample_seed
from cats.prompts import QUESTIONS, SHAREGPT, read_prompt_file
from tests.conftest import MT_BENCH, SHARED_DATA, STORIES_GGUF, STORIES_HF, needs, tiny_model
from cats.config import GenerationConfig

SHAREGPT_FILE = SHARED_DATA / "sharegpt" / "ShareGPT_V3_filtered_500.json"
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
STORY_PROMPTS = ["Lily saw a big red ball.", "Tom and his dog went to the park.", "The sun was hot.",
                 "A little bird could not fly.", "Sam had a toy car. He loved it very much and played every day.",
                 "Mom made a cake."]

pytestmark = needs(STORIES_HF)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on a busy 2-core machine are far faster on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    model = cats.load_model(STORIES_HF, dtype="float64")
    model.tokenizer.chat_template = CHAT_TEMPLATE
    return model


def sharegpt_file(path, prompts=STORY_PROMPTS):
    entries = [{"id": str(i), "conversations": [{"from": "system", "value": "Be nice."}, {"from": "human", "value": p},
                                                 {"from": "gpt", "value": "ok"}]} for i, p in enumerate(prompts)]
    path.write_text(json.dumps(entries))
    return path


def config(tmp_path, out="data", **overrides) -> DataConfig:
    prompts = tmp_path / "prompts.json"
    if not prompts.exists():
        sharegpt_file(prompts)
    settings = dict(prompts=prompts, out=tmp_path / out, layers=[3, 1], max_new_tokens=12, max_prompt_tokens=24,
                    samples_per_prompt=2, temperature=1.0, top_k=5, batch_size=3, shard_prompts=2, progress=False)
    return DataConfig(**{**settings, **overrides})


def shard_tensors(folder):
    meta = json.loads((folder / "meta.json").read_text())
    return [load_file(folder / shard["file"]) for shard in meta["shards"]]


def assert_same_data(first, second):
    for a, b in zip(shard_tensors(first), shard_tensors(second), strict=True):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def finished_run(model, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("run")
    meta = make_training_data(model, config(tmp_path))
    return tmp_path, meta


# ---------------------------------------------------------------- prompt files
def test_sharegpt_prompt_is_the_first_human_turn(tmp_path):
    path = tmp_path / "chats.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "gpt", "value": "hello"}, {"from": "human", "value": "first"},
                           {"from": "human", "value": "second"}]},
        {"conversations": [{"from": "gpt", "value": "no question here"}]},
        {"conversations": [{"from": "user", "value": "as user"}]},
    ]))
    prompts = read_prompt_file(path)
    assert prompts.format == SHAREGPT and prompts.texts == ["first", None, "as user"]


@needs(SHAREGPT_FILE)
def test_shared_prompt_files_are_detected_by_content(tmp_path):
    sharegpt = read_prompt_file(SHAREGPT_FILE)
    assert sharegpt.format == SHAREGPT and len(sharegpt.texts) == 500 and all(sharegpt.texts)
    renamed = tmp_path / "questions.txt"  # the name does not matter
    shutil.copy(MT_BENCH, renamed)
    questions = read_prompt_file(renamed)
    assert questions.format == QUESTIONS and len(questions.texts) == 80
    assert questions.texts[0].startswith("Compose an engaging travel blog post")


@pytest.mark.parametrize("content", ["just some text\n", '{"prompts": ["a"]}\n', "[1, 2]", '[{"text": "a"}]', ""])
def test_a_file_in_neither_format_is_refused_with_its_name(tmp_path, content):
    path = tmp_path / "odd.json"
    path.write_text(content)
    with pytest.raises(InvalidArgumentError, match=r"odd\.json.*(ShareGPT|conversations)"):
        read_prompt_file(path)
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        read_prompt_file(tmp_path / "missing.json")


# ---------------------------------------------------------------- the folder
def test_a_run_writes_the_documented_files(finished_run, model):
    folder, meta = finished_run
    assert sorted(p.name for p in folder.joinpath("data").iterdir()) == [
        "meta.json", "shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
    assert meta == json.loads((folder / "data" / "meta.json").read_text())
    assert meta["format"] == "cats-train-data/1" and meta["model"] == cats.model.identity.model_identity(model)
    assert meta["layers"] == [1, 3] and meta["top_k"] == 5 and meta["hidden_dtype"] == "bfloat16"
    assert meta["prompt_format"] == "sharegpt" and meta["num_prompts"] == 6 and meta["skipped_prompts"] == []
    assert meta["truncated_prompts"] == [4]  # the one prompt longer than 24 tokens
    ranges = [(s["first_prompt"], s["num_prompts"], s["samples"]) for s in meta["shards"]]
    assert ranges == [(0, 2, 4), (2, 2, 4), (4, 2, 4)]
    for shard, tensors in zip(meta["shards"], shard_tensors(folder / "data")):
        n, s = shard["tokens"], shard["samples"]
        expected = {"input_ids": (torch.int64, [n]), "sample_starts": (torch.int64, [s + 1]),
                    "prompt_lengths": (torch.int64, [s]), "prompt_index": (torch.int64, [s]),
                    "loss_mask": (torch.uint8, [n]), "hidden.1": (torch.bfloat16, [n, 64]),
                    "hidden.3": (torch.bfloat16, [n, 64]), "topk_ids": (torch.int32, [n, 5]),
                    "topk_probs": (torch.float16, [n, 5])}
        assert {name: (t.dtype, list(t.shape)) for name, t in tensors.items()} == expected
        assert tensors["sample_starts"][-1] == n and int(tensors["loss_mask"].sum()) == shard["response_tokens"]
        first = shard["first_prompt"]
        assert tensors["prompt_index"].tolist() == [first, first, first + 1, first + 1]


def test_sharegpt_given_answer_is_the_assistant_turn_right_after_the_prompt(tmp_path):
    path = tmp_path / "chats.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                           {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}]},
        {"conversations": [{"from": "human", "value": "q3"}, {"from": "human", "value": "q4"}]},
        {"conversations": [{"from": "user", "value": "q5"}, {"from": "assistant", "value": "  "}]},
        {"conversations": [{"from": "gpt", "value": "a0"}, {"from": "human", "value": "q6"},
                           {"from": "assistant", "value": "a6"}]},
    ]))
    prompts = read_prompt_file(path)
    assert prompts.texts == ["q1", "q3", "q5", "q6"] and prompts.answers == ["a1", None, None, "a6"]


def test_given_answers_are_teacher_forced_with_their_features_from_the_same_forward(model, tmp_path):
    path = tmp_path / "given.json"
    answers = ["Once upon a time there was a cat", None, "The dog ran home"]
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": prompt}] + ([{"from": "gpt", "value": answer}] if answer else [])}
        for prompt, answer in zip(STORY_PROMPTS, answers)]))
    settings = config(tmp_path, prompts=path, limit=3, samples_per_prompt=1, temperature=0.0, answers="given",
                      features=True)
    meta = make_training_data(model, settings)
    assert meta["answers"] == "given" and meta["features"] is True
    assert [s["prompt"] for s in meta["skipped_prompts"]] == [1]
    data = TrainingData.open(tmp_path / "data", model=model)
    assert data.num_samples == 2 and data.has_features
    for i, answer in enumerate(answers[::2]):
        sample = data.sample(i, features=True)
        ids, prompt_length = sample["input_ids"], sample["prompt_length"]
        expected_answer = model.tokenizer(answer, add_special_tokens=False)["input_ids"][: settings.max_new_tokens]
        assert ids[prompt_length:].tolist() == expected_answer  # the given text, not a generated one
        with torch.no_grad():
            final = model.forward_layers(model.embed(ids), 0, model.num_layers, model.new_cache())
            expected = model.decoder.norm(final)[0]
        torch.testing.assert_close(sample["features"].double(), expected, atol=1e-2, rtol=1e-2)
    # given answers take one teacher-forced sample per prompt: sampling settings are refused, not ignored
    with pytest.raises(InvalidArgumentError, match="--answers given"):
        make_training_data(model, config(tmp_path, out="other", prompts=path, answers="given"))
    without = tmp_path / "prompts-only.json"
    sharegpt_file(without)
    entries = json.loads(without.read_text())
    for entry in entries:
        entry["conversations"] = entry["conversations"][:2]
    without.write_text(json.dumps(entries))
    with pytest.raises(InvalidArgumentError, match="holds no assistant turn"):
        make_training_data(model, config(tmp_path, out="none", prompts=without, samples_per_prompt=1,
                                         temperature=0.0, answers="given"))


def test_stored_states_are_the_layered_forward_of_the_unpadded_sequence(finished_run, model):
    data = TrainingData.open(finished_run[0] / "data", model=model)
    assert data.num_samples == 12 and len(list(data)) == 12
    assert data.num_response_tokens == sum(s["response_tokens"] for s in data.meta["shards"])
    for i in (0, 5, 11):
        sample = data.sample(i)
        ids, prompt_length = sample["input_ids"], sample["prompt_length"]
        assert ids.dtype == torch.long and sample["topk_ids"].dtype == torch.long
        assert sample["topk_probs"].dtype == torch.float32 and sample["loss_mask"].dtype == torch.bool
        with torch.no_grad():
            for layer in (1, 3):
                expected = model.forward_layers(model.embed(ids), 0, layer, model.new_cache())[0]
                torch.testing.assert_close(sample["hidden"][layer].double(), expected, atol=1e-2, rtol=1e-2)
            probs = torch.softmax(model.forward(ids, model.new_cache()), dim=-1)
        top = probs.topk(5, dim=-1)
        assert torch.equal(sample["topk_ids"], top.indices)
        torch.testing.assert_close(sample["topk_probs"], top.values.float(), atol=1e-3, rtol=1e-3)
        # the loss mask marks exactly the positions whose next token is a response token
        response = torch.zeros(len(ids), dtype=torch.bool)
        response[prompt_length:] = True
        assert torch.equal(sample["loss_mask"][:-1], response[1:]) and not sample["loss_mask"][-1]


def test_reader_reads_only_requested_layers_and_counts_response_tokens(finished_run, model):
    data = TrainingData.open(finished_run[0] / "data")
    assert data.layers == [1, 3] and data.top_k == 5 and data.hidden_size == 64
    assert list(data.sample(2, layers=[3])["hidden"]) == [3]
    with pytest.raises(InvalidArgumentError, match=r"layers \[1, 3\], not \[2\]"):
        data.sample(0, layers=[2])
    expected = torch.zeros(model.vocab_size, dtype=torch.long)
    for sample in data:
        expected += torch.bincount(sample["input_ids"][sample["prompt_length"]:], minlength=model.vocab_size)
    counts = data.response_token_counts(model.vocab_size)
    assert torch.equal(counts, expected) and counts.sum() == data.num_response_tokens


def test_greedy_answers_are_the_targets_own_ar_decoding(model, tmp_path):
    """Batched, left-padded generation equals `cats.generate(method="ar")`, also where an answer stops at EOS
    early and the rest of its row is padding ("!" plays EOS here)."""
    prompts = [train_data.chat_prompt_ids(model, text, 64)[0] for text in STORY_PROMPTS]
    saved = model.hf_model.generation_config.eos_token_id
    model.hf_model.generation_config.eos_token_id = model.tokenizer.convert_tokens_to_ids("!")
    try:
        answers = generate_answers(model, prompts, 16, 0.0, [0] * len(prompts))
        reference = [cats.generate(model, ids, method="ar", generation=GenerationConfig(max_new_tokens=16)).token_ids for ids in prompts]
    finally:
        model.hf_model.generation_config.eos_token_id = saved
    assert answers == reference
    assert any(len(a) < 16 for a in answers) and any(len(a) == 16 for a in answers)


@needs(STORIES_GGUF)
def test_a_model_without_generate_answers_on_its_own_forward():
    """A GGUF file on its blocks runs on CATS's decoder classes, which have no ``generate``: the answers are its
    plain decoding all the same, and sampled ones are a function of their seeds."""
    model = cats.load_model(STORIES_GGUF)  # (its file holds no tokenizer CATS reads: the prompts are token ids)
    assert not hasattr(model.hf_model, "generate")
    prompts = [[1, 13, 45, 78, 200], [1, 99, 5, 300], [1, 7, 7, 120, 64, 33]]
    greedy = generate_answers(model, prompts, 12, 0.0, [0] * len(prompts))
    reference = [cats.generate(model, ids, method="ar", generation=GenerationConfig(max_new_tokens=12)).token_ids
                 for ids in prompts]
    assert greedy == reference
    seeds = [sample_seed(0, p, 0) for p in range(len(prompts))]
    sampled = generate_answers(model, prompts, 12, 1.0, seeds)
    assert sampled == [generate_answers(model, [ids], 12, 1.0, [seed])[0] for ids, seed in zip(prompts, seeds)]
    assert sampled != greedy


def test_sampling_is_seeded_per_prompt_and_sample_not_per_batch(model):
    prompts = [train_data.chat_prompt_ids(model, text, 64)[0] for text in STORY_PROMPTS[:4]]
    seeds = [sample_seed(0, p, 0) for p in range(4)]
    together = generate_answers(model, prompts, 10, 1.0, seeds)
    alone = [generate_answers(model, [ids], 10, 1.0, [seed])[0] for ids, seed in zip(prompts, seeds)]
    assert together == alone
    second_samples = generate_answers(model, prompts, 10, 1.0, [sample_seed(0, p, 1) for p in range(4)])
    assert second_samples != together


# ---------------------------------------------------------------- resuming
def test_a_killed_run_resumes_without_redoing_shards_and_gives_the_same_data(model, tmp_path, finished_run,
                                                                            monkeypatch):
    write_shard = train_data._write_shard
    made = []

    def killed_after_first_shard(out, index, tensors, prompt_range):
        if index == 1:
            raise KeyboardInterrupt
        return write_shard(out, index, tensors, prompt_range)

    monkeypatch.setattr(train_data, "_write_shard", killed_after_first_shard)
    with pytest.raises(KeyboardInterrupt):
        make_training_data(model, config(tmp_path))
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert [s["file"] for s in meta["shards"]] == ["shard-00000.safetensors"]

    make_shard = train_data._make_shard
    monkeypatch.setattr(train_data, "_write_shard", write_shard)
    monkeypatch.setattr(train_data, "_make_shard", lambda *a: made.append(a[4].start) or make_shard(*a))
    make_training_data(model, config(tmp_path))
    assert made == [2, 4]  # shard 0 (prompts 0-1) was not made again
    assert_same_data(tmp_path / "data", finished_run[0] / "data")
    made.clear()
    make_training_data(model, config(tmp_path))  # a finished folder: nothing to do
    assert made == []


def test_a_larger_limit_extends_the_data_and_a_smaller_one_is_refused(model, tmp_path, finished_run):
    make_training_data(model, config(tmp_path, limit=3))
    assert [s["num_prompts"] for s in TrainingData.open(tmp_path / "data").shards] == [2, 1]
    make_training_data(model, config(tmp_path, limit=6))  # the partial shard is made again for prompts 2-3
    assert_same_data(tmp_path / "data", finished_run[0] / "data")
    with pytest.raises(InvalidArgumentError, match="started for 6 prompts; this run selects only 4"):
        make_training_data(model, config(tmp_path, limit=4))


@pytest.mark.parametrize("change, message", [
    (dict(layers=[1, 2]), r"layers=\[1, 3\], but this run asks for layers=\[1, 2\]"),
    (dict(temperature=0.5), "temperature=1.0, but this run asks for temperature=0.5"),
    (dict(seed=1, top_k=4), "top_k=5, seed=0, but this run asks for top_k=4, seed=1"),
])
def test_other_arguments_into_the_same_folder_are_refused(model, finished_run, tmp_path, change, message):
    folder = tmp_path / "data"
    shutil.copytree(finished_run[0] / "data", folder)
    shutil.copy(finished_run[0] / "prompts.json", tmp_path / "prompts.json")
    with pytest.raises(InvalidArgumentError, match=message):
        make_training_data(model, config(tmp_path, **change))


def test_another_prompt_file_content_is_refused(model, finished_run, tmp_path):
    shutil.copytree(finished_run[0] / "data", tmp_path / "data")
    sharegpt_file(tmp_path / "prompts.json", STORY_PROMPTS[::-1])
    with pytest.raises(InvalidArgumentError, match="prompts_sha256="):
        make_training_data(model, config(tmp_path))


def test_a_folder_that_is_not_training_data_is_not_touched(model, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("mine")
    with pytest.raises(InvalidArgumentError, match="not a CATS training-data folder"):
        make_training_data(model, config(tmp_path))


# ---------------------------------------------------------------- bad input
def test_missing_shard_is_named(finished_run, model, tmp_path):
    folder = tmp_path / "data"
    shutil.copytree(finished_run[0] / "data", folder)
    (folder / "shard-00001.safetensors").unlink()
    with pytest.raises(InvalidArgumentError, match="shard shard-00001.safetensors listed in meta.json is missing"):
        TrainingData.open(folder)
    shutil.copy(finished_run[0] / "prompts.json", tmp_path / "prompts.json")
    with pytest.raises(InvalidArgumentError, match="shard-00001.safetensors listed in meta.json is missing"):
        make_training_data(model, config(tmp_path))
    with pytest.raises(InvalidArgumentError, match="no meta.json"):
        TrainingData.open(tmp_path)
    (folder / "meta.json").write_text('{"format": "something-else/2"}')
    with pytest.raises(InvalidArgumentError, match="format 'something-else/2'; expected 'cats-train-data/1'"):
        TrainingData.open(folder)


def test_data_from_another_model_is_refused(finished_run, model, tmp_path):
    other = tiny_model("llama")
    message = (r"made from model '.*stories260k-gguf/hf' \(fingerprint [0-9a-f]{16}\), "
               r"not from 'tiny-llama' \(fingerprint [0-9a-f]{16}\)")
    with pytest.raises(InvalidArgumentError, match=message):
        TrainingData.open(finished_run[0] / "data", model=other)
    other.tokenizer = model.tokenizer
    shutil.copytree(finished_run[0] / "data", tmp_path / "data")
    shutil.copy(finished_run[0] / "prompts.json", tmp_path / "prompts.json")
    with pytest.raises(InvalidArgumentError, match="not from 'tiny-llama'"):
        make_training_data(other, config(tmp_path))


@pytest.mark.parametrize("change, message", [
    (dict(layers=[0]), "layer 0 is out of range: .* has 5 layers, so hidden states after layers 1 .. 4"),
    (dict(layers=[2, 5]), "layer 5 is out of range"),
    (dict(layers=[]), "at least one layer"),
    (dict(temperature=0.0), "--samples-per-prompt above 1 needs --temperature above 0"),
    (dict(temperature=-1.0), "--temperature must be 0"),
    (dict(batch_size=0), "--batch-size must be a positive integer"),
    (dict(top_k=1000), "--top-k 1000 exceeds the vocabulary size 512"),
    (dict(max_new_tokens=2030), "exceed the model's context window of 2048"),
])
def test_bad_settings_are_refused(model, tmp_path, change, message):
    with pytest.raises(InvalidArgumentError, match=message):
        make_training_data(model, config(tmp_path, **change))
    assert not (tmp_path / "data").exists()


def test_a_model_without_chat_template_is_refused(tmp_path):
    plain = cats.load_model(STORIES_HF)
    with pytest.raises(InvalidArgumentError, match="has no chat template; cats train data applies it"):
        make_training_data(plain, config(tmp_path))


def test_prompts_without_a_question_or_too_long_for_the_template_are_skipped(model, tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": "Lily ran."}]},
                                {"conversations": []}, {"conversations": [{"from": "human", "value": "Tom sat."}]}]))
    meta = make_training_data(model, config(tmp_path, samples_per_prompt=1, temperature=0.0, shard_prompts=4))
    assert meta["skipped_prompts"] == [{"prompt": 1, "reason": "no human turn"}]
    data = TrainingData.open(tmp_path / "data")
    assert [data.sample(i)["prompt_index"] for i in range(len(data))] == [0, 2]
    meta = make_training_data(model, config(tmp_path, out="short", samples_per_prompt=1, temperature=0.0,
                                            max_prompt_tokens=2))
    assert [s["prompt"] for s in meta["skipped_prompts"]] == [0, 1, 2]
    assert "no token of the prompt fits into 2 tokens" in meta["skipped_prompts"][0]["reason"]
    assert TrainingData.open(tmp_path / "short").num_samples == 0


# ---------------------------------------------------------------- command line
def run_cli(*argv) -> int:
    parser = argparse.ArgumentParser(prog="cats train")
    add_data_parser(parser.add_subparsers(dest="step", required=True))
    args = parser.parse_args(["data", *map(str, argv)])
    return args.run(args)


def test_cli_run_with_a_chat_model_folder(tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(STORIES_HF, folder)
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": CHAT_TEMPLATE}))
    prompts = sharegpt_file(tmp_path / "prompts.json", STORY_PROMPTS[:3])
    args = ["--model", folder, "--prompts", prompts, "--out", tmp_path / "data", "--layers", "2,4",
            "--max-new-tokens", 6, "--limit", 2, "--no-progress"]
    assert run_cli(*args) == 0
    assert "response tokens/s" in capsys.readouterr().err
    assert TrainingData.open(tmp_path / "data").layers == [2, 4]
    with pytest.raises(InvalidArgumentError, match="--layers expects comma-separated layer numbers"):
        run_cli(*args[:-3], "--layers", "2,x")
    with pytest.raises(InvalidArgumentError, match="has no chat template"):
        run_cli("--model", STORIES_HF, *args[2:])
