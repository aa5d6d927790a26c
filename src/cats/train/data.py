"""Self-distillation training data: the target answers prompts itself, and per sample we store what an adapter
learns from: token ids, a loss mask over the response, hidden states after chosen layers and the target's top-k
next-token distribution. ``cats train data`` writes a folder; `TrainingData` reads it.

Folder format ``cats-train-data/1``:

* ``meta.json``: the settings the data depends on (model identity and dtype, layers, top_k, prompt file and its
  SHA-256, generation settings, seed, prompts per shard), ``num_prompts`` (prompts selected), ``shards`` (the
  complete shards, in order: ``file``, ``first_prompt``, ``num_prompts``, ``samples``, ``tokens``,
  ``response_tokens``), ``skipped_prompts`` (``{"prompt", "reason"}``) and ``truncated_prompts`` (indices).
  Prompt indices count entries of the prompt file, from 0.
* ``shard-NNNNN.safetensors``: shard k holds the samples of prompts ``[k * shard_prompts, ...)``, prompt by prompt,
  sample by sample, concatenated along one token axis of length N:

  ==================  ===========  =====================================================================
  ``input_ids``       int64 [N]    prompt + response of each sample (response cut after its first EOS)
  ``sample_starts``   int64 [S+1]  sample s is rows ``sample_starts[s] : sample_starts[s+1]``
  ``prompt_lengths``  int64 [S]    prompt tokens of each sample (chat template included)
  ``prompt_index``    int64 [S]    the prompt each sample answers (index in the prompt file)
  ``loss_mask``       uint8 [N]    1 at position t iff token t+1 is a response token
  ``hidden.{L}``      bf16 [N, H]  hidden state after L decoder layers (the input of 0-based layer L)
  ``topk_ids``        int32 [N, K] the target's K most likely next tokens at each position
  ``topk_probs``      fp16 [N, K]  their probabilities (softmax of the final logits, temperature 1)
  ==================  ===========  =====================================================================

Final features (for feature draft adapters, ``cats train features``): ``features-NNNNN.safetensors`` beside shard
NNNNN holds ``features`` bf16 [N, H], the target's final normed state at each position (what its lm_head reads),
from a teacher-forced forward of each unpadded sample in the data's dtype; files are written under temporary names
and renamed, so a killed run resumes at the first shard without one.

Every stored state comes from a teacher-forced forward of the UNPADDED sequence through `LayeredModel`, so it is
exactly what ``forward_layers(embed(ids), 0, L, cache)`` gives; only the answers come from batched generation.

Resuming: shards and ``meta.json`` are written under temporary names and renamed, ``meta.json`` after every shard.
A rerun with the same settings skips the shards listed in ``meta.json`` (a killed run loses at most the shard in
progress). ``--limit`` may grow on a rerun (the data is extended; a last, partial shard is made again for its full
prompt range) but not shrink; any other changed setting, or another model, is refused.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import math
import os
import sys
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from cats.errors import InvalidArgumentError
from cats.model.identity import model_fingerprint, model_identity
from cats.train.prompts import chat_prompt_ids, read_prompt_file

FORMAT = "cats-train-data/1"
HIDDEN_DTYPE = "bfloat16"
META = "meta.json"
# meta.json keys that must be equal for a rerun to continue a folder (the model is compared by fingerprint and the
# prompt file by content, so a moved model or prompt file does not block a resume)
SETTINGS_CHECKED_ON_RESUME = (
    "dtype", "layers", "top_k", "hidden_dtype", "prompts_sha256", "prompt_format", "max_new_tokens",
    "max_prompt_tokens", "samples_per_prompt", "temperature", "seed", "shard_prompts",
)


@dataclass
class DataConfig:
    """Settings of one ``cats train data`` run (the CLI flags)."""

    prompts: str | Path
    out: str | Path
    layers: list[int]
    max_new_tokens: int = 256
    max_prompt_tokens: int = 256
    samples_per_prompt: int = 1
    temperature: float = 0.0  # 0: greedy; > 0: sampling, seeded per prompt and sample
    top_k: int = 20
    limit: int | None = None
    batch_size: int = 8
    shard_prompts: int = 64
    seed: int = 0
    progress: bool = True

    def validate(self, model) -> None:
        """Raise `InvalidArgumentError` for any setting this model cannot be run with."""
        positive = {"max_new_tokens": self.max_new_tokens, "max_prompt_tokens": self.max_prompt_tokens,
                    "samples_per_prompt": self.samples_per_prompt, "top_k": self.top_k,
                    "batch_size": self.batch_size, "shard_prompts": self.shard_prompts}
        if self.limit is not None:
            positive["limit"] = self.limit
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise InvalidArgumentError(f"--seed must be a non-negative integer, got {self.seed!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgumentError(f"--temperature must be 0 (greedy) or positive, got {self.temperature!r}")
        if self.temperature == 0 and self.samples_per_prompt > 1:
            raise InvalidArgumentError("--samples-per-prompt above 1 needs --temperature above 0: greedy answers "
                                       "to the same prompt are all the same")
        if not self.layers:
            raise InvalidArgumentError("--layers needs at least one layer")
        for layer in self.layers:
            if not isinstance(layer, int) or not 1 <= layer < model.num_layers:
                raise InvalidArgumentError(
                    f"layer {layer!r} is out of range: {model.name} has {model.num_layers} layers, so hidden states "
                    f"after layers 1 .. {model.num_layers - 1} can be stored")
        if self.top_k > model.vocab_size:
            raise InvalidArgumentError(f"--top-k {self.top_k} exceeds the vocabulary size {model.vocab_size}")
        if self.max_prompt_tokens + self.max_new_tokens > model.context_length:
            raise InvalidArgumentError(
                f"--max-prompt-tokens {self.max_prompt_tokens} plus --max-new-tokens {self.max_new_tokens} exceed "
                f"the model's context window of {model.context_length} tokens")
        if model.tokenizer is None:
            raise InvalidArgumentError(f"model {model.name!r} has no tokenizer; cats train data needs one")
        if not getattr(model.tokenizer, "chat_template", None):
            raise InvalidArgumentError(f"model {model.name!r} has no chat template; cats train data applies it to "
                                       "every prompt")


# ====================================================================== writing
def make_training_data(model, config: DataConfig) -> dict:
    """Generate (or continue) the data folder ``config.out``; return its final ``meta.json`` content."""
    config.validate(model)
    config.layers = sorted(set(config.layers))
    prompt_file = read_prompt_file(config.prompts)
    texts = prompt_file.texts[: config.limit]
    out = Path(config.out)
    settings = {
        "format": FORMAT,
        "model": model_identity(model),
        "dtype": str(model.dtype).removeprefix("torch."),
        "layers": config.layers,
        "hidden_size": model.config.hidden_size,
        "top_k": config.top_k,
        "hidden_dtype": HIDDEN_DTYPE,
        "prompts_file": str(prompt_file.path),
        "prompts_sha256": prompt_file.sha256,
        "prompt_format": prompt_file.format,
        "max_new_tokens": config.max_new_tokens,
        "max_prompt_tokens": config.max_prompt_tokens,
        "samples_per_prompt": config.samples_per_prompt,
        "temperature": float(config.temperature),
        "seed": config.seed,
        "shard_prompts": config.shard_prompts,
    }
    meta = _open_for_writing(out, settings, len(texts))
    prompts, skipped, truncated = _encode_prompts(model, texts, config.max_prompt_tokens)
    meta.update(num_prompts=len(texts), skipped_prompts=skipped, truncated_prompts=truncated)
    _write_meta(out, meta)

    num_shards = math.ceil(len(texts) / config.shard_prompts)
    done_prompts = sum(shard["num_prompts"] for shard in meta["shards"])
    run_samples = run_tokens = 0
    started = time.perf_counter()
    bar = _progress_bar(config.progress, len(texts), done_prompts)
    try:
        for index in range(len(meta["shards"]), num_shards):
            first = index * config.shard_prompts
            prompt_range = range(first, min(first + config.shard_prompts, len(texts)))
            shard_started = time.perf_counter()
            tensors = _make_shard(model, config, prompts, prompt_range, bar)
            entry = _write_shard(out, index, tensors, prompt_range)
            meta["shards"].append(entry)
            _write_meta(out, meta)
            seconds = time.perf_counter() - shard_started
            run_samples += entry["samples"]
            run_tokens += entry["response_tokens"]
            _report(bar, f"{entry['file']}: prompts {first}-{prompt_range[-1]}, {entry['samples']} samples, "
                         f"{entry['response_tokens']} response tokens in {seconds:.1f} s "
                         f"({entry['response_tokens'] / max(seconds, 1e-9):.1f} response tokens/s)")
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - started
    total_samples = sum(shard["samples"] for shard in meta["shards"])
    total_tokens = sum(shard["response_tokens"] for shard in meta["shards"])
    print(f"cats train data: this run {run_samples} samples, {run_tokens} response tokens in {seconds:.1f} s "
          f"({run_tokens / max(seconds, 1e-9):.1f} response tokens/s); {out} holds {total_samples} samples, "
          f"{total_tokens} response tokens in {len(meta['shards'])} shards; {len(skipped)} prompts skipped, "
          f"{len(truncated)} truncated", file=sys.stderr)
    return meta


def _encode_prompts(model, texts, max_tokens) -> tuple[list[list[int] | None], list[dict], list[int]]:
    """Chat-template ids of every prompt (None where skipped), the skipped prompts with reasons, the truncated ones."""
    prompts, skipped, truncated = [], [], []
    for index, text in enumerate(texts):
        ids, was_truncated = (None, False) if text is None else chat_prompt_ids(model, text, max_tokens)
        if text is None:
            skipped.append({"prompt": index, "reason": "no human turn"})
        elif ids is None:
            reason = f"no token of the prompt fits into {max_tokens} tokens with the chat template"
            skipped.append({"prompt": index, "reason": reason})
        elif was_truncated:
            truncated.append(index)
        prompts.append(ids)
    return prompts, skipped, truncated


def _open_for_writing(out: Path, settings: dict, num_prompts: int) -> dict:
    """A new folder's meta, or the existing one after checking it was made with the same settings."""
    if not (out / META).exists():
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise InvalidArgumentError(f"{out} exists and is not a CATS training-data folder (no {META}); "
                                       "pass a new or empty folder")
        out.mkdir(parents=True, exist_ok=True)
        return {**settings, "num_prompts": num_prompts, "shards": [], "skipped_prompts": [], "truncated_prompts": []}
    meta = _read_meta(out)
    _check_same_model(meta, settings["model"], out)
    changed = [key for key in SETTINGS_CHECKED_ON_RESUME if meta.get(key) != settings[key]]
    if changed:
        was = ", ".join(f"{key}={meta.get(key)!r}" for key in changed)
        now = ", ".join(f"{key}={settings[key]!r}" for key in changed)
        raise InvalidArgumentError(f"{out} holds data made with {was}, but this run asks for {now}; rerun with the "
                                   "same arguments to continue it, or pass another --out")
    if num_prompts < meta["num_prompts"]:
        raise InvalidArgumentError(f"{out} was started for {meta['num_prompts']} prompts; this run selects only "
                                   f"{num_prompts} (--limit may grow on a rerun, not shrink)")
    _check_shards_exist(meta, out)
    shards = meta["shards"]
    if shards and shards[-1]["num_prompts"] < settings["shard_prompts"] and num_prompts > meta["num_prompts"]:
        # the last shard ended at the old --limit: make it again for its full prompt range (its file stays until
        # the new one replaces it; unlisted, it is not part of the data)
        shards.pop()
    return meta


def _check_same_model(meta: dict, identity: dict, path: Path) -> None:
    made_from = meta["model"]
    if made_from.get("fingerprint") != identity["fingerprint"]:
        raise InvalidArgumentError(
            f"the training data in {path} was made from model {made_from.get('name')!r} (fingerprint "
            f"{made_from.get('fingerprint')}), not from {identity['name']!r} (fingerprint {identity['fingerprint']})")


def _check_shards_exist(meta: dict, path: Path) -> None:
    for shard in meta["shards"]:
        if not (path / shard["file"]).is_file():
            raise InvalidArgumentError(f"{path}: shard {shard['file']} listed in {META} is missing")


def _make_shard(model, config: DataConfig, prompts, prompt_range: range, bar) -> dict[str, torch.Tensor]:
    """Answer every (prompt, sample) of the range, teacher-force each answer, and pack the shard's tensors."""
    jobs = [(p, s) for p in prompt_range if prompts[p] is not None for s in range(config.samples_per_prompt)]
    if bar is not None:
        bar.update(len(prompt_range) - len({p for p, _ in jobs}))  # skipped prompts are done at once
    unfinished = {p: config.samples_per_prompt for p, _ in jobs}
    by_length = sorted(jobs, key=lambda job: (len(prompts[job[0]]), job))  # batches of similar length pad little
    records = {}
    for start in range(0, len(by_length), config.batch_size):
        batch = by_length[start : start + config.batch_size]
        seeds = [sample_seed(config.seed, p, s) for p, s in batch]
        answers = generate_answers(model, [prompts[p] for p, _ in batch], config.max_new_tokens,
                                   config.temperature, seeds)
        for (p, s), answer in zip(batch, answers):
            records[p, s] = teacher_forward(model, prompts[p] + answer, len(prompts[p]), config.layers, config.top_k)
            unfinished[p] -= 1
            if unfinished[p] == 0 and bar is not None:
                bar.update(1)
    return _pack([records[job] | {"prompt_index": job[0]} for job in jobs], config.layers, model.config.hidden_size,
                 config.top_k)


def sample_seed(seed: int, prompt: int, sample: int) -> int:
    """The random stream of one answer: a function of (seed, prompt index, sample index) only."""
    digest = hashlib.sha256(f"cats-train-data:{seed}:{prompt}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class SeededSampling:
    """Logits processor that turns greedy decoding into sampling at ``temperature`` with one random stream per row.

    Gumbel-max: ``argmax(logits / T + G)`` with independent standard Gumbel noise G is an exact sample from
    ``softmax(logits / T)``. Drawing G from a generator per row (seeded by `sample_seed`, V numbers per step) makes
    each answer depend on its own seed only, not on which other answers share its batch or on the batch size, as
    transformers' ``do_sample`` would (it draws for the whole batch from the global generator)."""

    def __init__(self, seeds: list[int], temperature: float):
        self.temperature = temperature
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        uniform = torch.stack([torch.rand(scores.shape[-1], generator=g, dtype=torch.float64) for g in self.generators])
        gumbel = -torch.log(-torch.log(uniform))  # uniform == 0 gives -inf: never chosen, as it should be
        return scores.double() / self.temperature + gumbel.to(scores.device)


@contextmanager
def _plain_generation_defaults(hf_model):
    """Hide the model's own generation_config (which may carry repetition penalties, top-p, ...) during generate:
    the data must be the target's plain distribution, as ``cats generate`` decodes it."""
    from transformers import GenerationConfig

    saved = hf_model.generation_config
    hf_model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        hf_model.generation_config = saved


def pad_token_id(model) -> int:
    tokenizer_pad = getattr(model.tokenizer, "pad_token_id", None)
    if tokenizer_pad is not None:
        return int(tokenizer_pad)
    return min(model.eos_token_ids) if model.eos_token_ids else 0


@torch.inference_mode()
def generate_answers(model, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                     seeds: list[int]) -> list[list[int]]:
    """Batched ``hf_model.generate`` on left-padded prompts; each answer is cut after its first EOS (inclusive)."""
    from transformers import LogitsProcessorList

    width = max(len(ids) for ids in prompts)
    pad = pad_token_id(model)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    eos = model.eos_token_ids
    processors = LogitsProcessorList([SeededSampling(seeds, temperature)] if temperature > 0 else [])
    with _plain_generation_defaults(model.hf_model):
        output = model.hf_model.generate(
            input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
            max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, logits_processor=processors,
            eos_token_id=sorted(eos) if eos else None, pad_token_id=pad,
        )
    answers = []
    for row in output[:, width:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        answers.append(row[:end])
    return answers


@torch.inference_mode()
def teacher_forward(model, ids: list[int], prompt_length: int, layers: list[int], top_k: int) -> dict:
    """One sample's record from a forward of the unpadded sequence: hidden states after each of ``layers``
    (ascending), and the top-k of the final next-token distribution at every position."""
    cache = model.new_cache()
    hidden = model.embed(torch.tensor(ids))
    states, done = {}, 0
    for layer in layers:
        hidden = model.forward_layers(hidden, done, layer, cache)
        states[layer] = hidden[0].to(torch.bfloat16).cpu()
        done = layer
    hidden = model.forward_layers(hidden, done, model.num_layers, cache)
    probs = torch.softmax(model.head(hidden)[0].float(), dim=-1)
    top = probs.topk(top_k, dim=-1)
    loss_mask = torch.zeros(len(ids), dtype=torch.uint8)
    loss_mask[prompt_length - 1 : len(ids) - 1] = 1
    return {"input_ids": torch.tensor(ids, dtype=torch.long), "prompt_length": prompt_length, "loss_mask": loss_mask,
            "hidden": states, "topk_ids": top.indices.to(torch.int32).cpu(),
            "topk_probs": top.values.to(torch.float16).cpu()}


def _pack(records: list[dict], layers: list[int], hidden_size: int, top_k: int) -> dict[str, torch.Tensor]:
    lengths = [len(r["input_ids"]) for r in records]
    starts = torch.zeros(len(records) + 1, dtype=torch.long)
    starts[1:] = torch.tensor(lengths, dtype=torch.long).cumsum(0) if records else starts[1:]

    def cat(key, empty):
        return torch.cat([r[key] for r in records]) if records else empty

    tensors = {
        "input_ids": cat("input_ids", torch.zeros(0, dtype=torch.long)),
        "sample_starts": starts,
        "prompt_lengths": torch.tensor([r["prompt_length"] for r in records], dtype=torch.long),
        "prompt_index": torch.tensor([r["prompt_index"] for r in records], dtype=torch.long),
        "loss_mask": cat("loss_mask", torch.zeros(0, dtype=torch.uint8)),
        "topk_ids": cat("topk_ids", torch.zeros(0, top_k, dtype=torch.int32)),
        "topk_probs": cat("topk_probs", torch.zeros(0, top_k, dtype=torch.float16)),
    }
    for layer in layers:
        tensors[f"hidden.{layer}"] = (torch.cat([r["hidden"][layer] for r in records]) if records
                                      else torch.zeros(0, hidden_size, dtype=torch.bfloat16))
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def _write_shard(out: Path, index: int, tensors: dict[str, torch.Tensor], prompt_range: range) -> dict:
    from safetensors.torch import save_file

    name = shard_name(index)
    temporary = out / (name + ".tmp")
    save_file(tensors, str(temporary), metadata={"format": FORMAT})
    os.replace(temporary, out / name)
    return {"file": name, "first_prompt": prompt_range.start, "num_prompts": len(prompt_range),
            "samples": len(tensors["prompt_lengths"]), "tokens": len(tensors["input_ids"]),
            "response_tokens": int(tensors["loss_mask"].sum())}


def _write_meta(out: Path, meta: dict) -> None:
    temporary = out / (META + ".tmp")
    temporary.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(temporary, out / META)


def _read_meta(path: Path) -> dict:
    meta_path = path / META
    if not meta_path.is_file():
        raise InvalidArgumentError(f"{path} is not a CATS training-data folder: it has no {META}")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as error:
        raise InvalidArgumentError(f"{meta_path} is not valid JSON ({error.msg})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise InvalidArgumentError(f"{meta_path} has format {found!r}; expected {FORMAT!r}")
    return meta


def _progress_bar(enabled: bool, total: int, initial: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="prompt", desc="cats train data", dynamic_ncols=True)


def _report(bar, line: str) -> None:
    if bar is not None:
        bar.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr)


# ====================================================================== final features
def features_name(shard_file: str) -> str:
    """``shard-00003.safetensors`` -> ``features-00003.safetensors``."""
    return "features-" + shard_file.removeprefix("shard-")


@torch.inference_mode()
def make_features(model, path: str | Path, progress: bool = True) -> int:
    """Write the final-feature file of every shard of data folder ``path`` that lacks one; return how many were
    written. ``model`` must be the data's model in the data's dtype (the features must be what decoding sees)."""
    from safetensors.torch import save_file

    data = TrainingData.open(path, model=model)
    wanted, have = str(data.meta["dtype"]), str(model.dtype).removeprefix("torch.")
    if have != wanted:
        raise InvalidArgumentError(f"{data.path} was made in {wanted}; load the model with --dtype {wanted} to "
                                   f"compute its features (it is {have})")
    todo = [i for i, shard in enumerate(data.shards) if not (data.path / features_name(shard["file"])).is_file()]
    bar = None
    if progress and todo:
        from tqdm import tqdm

        bar = tqdm(total=sum(data.shards[i]["tokens"] for i in todo), unit="tok", desc="cats train features",
                   dynamic_ncols=True)
    for index in todo:
        rows = []
        for ids in data.shard_input_ids(index):
            hidden = model.forward_layers(model.embed(ids), 0, model.num_layers, model.new_cache())
            rows.append(model.decoder.norm(hidden)[0].to(torch.bfloat16).cpu())
            if bar is not None:
                bar.update(ids.numel())
        name = features_name(data.shards[index]["file"])
        temporary = data.path / (name + ".tmp")
        save_file({"features": torch.cat(rows) if rows else torch.zeros(0, data.hidden_size, dtype=torch.bfloat16)},
                  str(temporary), metadata={"format": FORMAT})
        os.replace(temporary, data.path / name)
    if bar is not None:
        bar.close()
    return len(todo)


# ====================================================================== reading
class TrainingData:
    """A data folder made by ``cats train data``, read lazily: shards are opened with safetensors ``safe_open``
    (memory-mapped; at most two held open) and each `sample` reads only its own rows."""

    MAX_OPEN_SHARDS = 2

    def __init__(self, path: Path, meta: dict):
        self.path, self.meta = path, meta
        self.shards = meta["shards"]
        self._first_sample = [0]
        for shard in self.shards:
            self._first_sample.append(self._first_sample[-1] + shard["samples"])
        self._open: OrderedDict[int, tuple] = OrderedDict()
        self._features: OrderedDict[int, object] = OrderedDict()
        self._lengths: list[int] | None = None

    @classmethod
    def open(cls, path: str | Path, model=None) -> "TrainingData":
        """Open a data folder; with ``model``, refuse data made from another model (by fingerprint)."""
        path = Path(path)
        meta = _read_meta(path)
        _check_shards_exist(meta, path)
        if model is not None:
            _check_same_model(meta, {"name": model.name, "fingerprint": model_fingerprint(model)}, path)
        return cls(path, meta)

    @property
    def layers(self) -> list[int]:
        return list(self.meta["layers"])

    @property
    def top_k(self) -> int:
        return self.meta["top_k"]

    @property
    def hidden_size(self) -> int:
        return self.meta["hidden_size"]

    @property
    def num_samples(self) -> int:
        return self._first_sample[-1]

    @property
    def num_response_tokens(self) -> int:
        return sum(shard["response_tokens"] for shard in self.shards)

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self):
        for i in range(self.num_samples):
            yield self.sample(i)

    @property
    def has_features(self) -> bool:
        """Whether every shard has its final-feature file (``cats train features``)."""
        return all((self.path / features_name(shard["file"])).is_file() for shard in self.shards)

    def sample(self, i: int, layers: list[int] | None = None, features: bool = False) -> dict:
        """Sample ``i``: ``input_ids`` [T] long, ``loss_mask`` [T] bool, ``prompt_length``, ``prompt_index``,
        ``hidden`` {L: [T, H] bf16} (``layers``: only these, default all), ``topk_ids`` [T, K] long,
        ``topk_probs`` [T, K] float32; with ``features``, also ``features`` [T, H] bf16 (the final normed states)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range: {self.path} holds {self.num_samples} samples")
        layers = self.layers if layers is None else layers
        unknown = sorted(set(layers) - set(self.layers))
        if unknown:
            raise InvalidArgumentError(f"{self.path} stores hidden states after layers {self.layers}, not {unknown}")
        shard_index = bisect.bisect_right(self._first_sample, i) - 1
        handle, starts, prompt_lengths, prompt_index = self._shard(shard_index)
        local = i - self._first_sample[shard_index]
        rows = slice(int(starts[local]), int(starts[local + 1]))

        def read(name):
            return handle.get_slice(name)[rows]

        record = {
            "input_ids": read("input_ids").long(),
            "loss_mask": read("loss_mask").bool(),
            "prompt_length": int(prompt_lengths[local]),
            "prompt_index": int(prompt_index[local]),
            "hidden": {layer: read(f"hidden.{layer}") for layer in layers},
            "topk_ids": read("topk_ids").long(),
            "topk_probs": read("topk_probs").float(),
        }
        if features:
            record["features"] = self._feature_handle(shard_index).get_slice("features")[rows]
        return record

    def _feature_handle(self, index: int):
        from safetensors import safe_open

        if index not in self._features:
            file = self.path / features_name(self.shards[index]["file"])
            if not file.is_file():
                raise InvalidArgumentError(f"{self.path} has no final features for {self.shards[index]['file']}; "
                                           f"compute them with `cats train features --data {self.path}`")
            self._features[index] = safe_open(str(file), framework="pt")
            while len(self._features) > self.MAX_OPEN_SHARDS:
                self._features.popitem(last=False)
        return self._features[index]

    def shard_input_ids(self, index: int) -> list[torch.Tensor]:
        """The token ids ``[T]`` of every sample of shard ``index``, in order (one read of its ``input_ids``)."""
        handle, starts = self._shard(index)[:2]
        ids = handle.get_tensor("input_ids").long()
        return [ids[a:b] for a, b in zip(starts, starts[1:])]

    def sample_length(self, i: int) -> int:
        """Tokens of sample ``i`` (prompt + response), without reading its tensors."""
        if self._lengths is None:
            self._lengths = []
            for index in range(len(self.shards)):
                starts = self._shard(index)[1]
                self._lengths.extend(b - a for a, b in zip(starts, starts[1:]))
        return self._lengths[i]

    def response_token_counts(self, vocab_size: int) -> torch.Tensor:
        """``LongTensor[vocab_size]``: how often each token occurs as a response token (for a reduced draft
        vocabulary). Position t with ``loss_mask[t] = 1`` predicts token t+1, which always lies in the same sample."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for index in range(len(self.shards)):
            handle = self._shard(index)[0]
            ids, mask = handle.get_tensor("input_ids"), handle.get_tensor("loss_mask").bool()
            responses = ids[1:][mask[:-1]]
            if responses.numel() and int(responses.max()) >= vocab_size:
                raise InvalidArgumentError(f"{self.path} holds token id {int(responses.max())}, outside a "
                                           f"{vocab_size}-token vocabulary")
            counts += torch.bincount(responses, minlength=vocab_size)
        return counts

    def _shard(self, index: int) -> tuple:
        """``(safe_open handle, sample_starts, prompt_lengths, prompt_index)`` of shard ``index``, opened on demand."""
        from safetensors import safe_open

        if index in self._open:
            self._open.move_to_end(index)
            return self._open[index]
        shard = self.shards[index]
        handle = safe_open(str(self.path / shard["file"]), framework="pt")
        starts = handle.get_tensor("sample_starts")
        if len(starts) != shard["samples"] + 1:
            raise InvalidArgumentError(f"{self.path}: {shard['file']} holds {len(starts) - 1} samples but {META} "
                                       f"lists {shard['samples']}")
        entry = (handle, starts.tolist(), handle.get_tensor("prompt_lengths").tolist(),
                 handle.get_tensor("prompt_index").tolist())
        self._open[index] = entry
        while len(self._open) > self.MAX_OPEN_SHARDS:
            self._open.popitem(last=False)
        return entry


# ====================================================================== command line
def parse_layers(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InvalidArgumentError(f"--layers expects comma-separated layer numbers such as 3,15; "
                                   f"got {text!r}") from None


def add_data_parser(subparsers) -> None:
    from cats.cli import add_model_arguments, integer

    data = subparsers.add_parser(
        "data", help="self-distillation data: the target answers prompts, hidden states and top-k are stored",
        description="The target answers every prompt itself (batched generation, chat template applied); per sample "
                    "the token ids, a loss mask over the response, hidden states after --layers and the target's top-k "
                    "next-token probabilities are written to safetensors shards in --out. A rerun with the same "
                    "arguments continues after the last complete shard; a larger --limit extends the data.",
    )
    add_model_arguments(data)
    data.add_argument("--prompts", type=Path, required=True,
                      help="ShareGPT JSON (first human turn) or Spec-Bench / MT-Bench .jsonl (first turn)")
    data.add_argument("--out", type=Path, required=True, help="data folder (created; reused to resume)")
    data.add_argument("--layers", required=True, help="store hidden states after these layers, e.g. 3,15 "
                      "(each in 1 .. num_layers-1)")
    data.add_argument("--max-new-tokens", type=integer, default=256, help="answer length limit (default 256)")
    data.add_argument("--max-prompt-tokens", type=integer, default=256,
                      help="longer prompts keep the end of their user text (default 256, chat template included)")
    data.add_argument("--samples-per-prompt", type=integer, default=1, help="answers per prompt (needs "
                      "--temperature > 0 above 1)")
    data.add_argument("--temperature", type=float, default=0.0,
                      help="0: greedy (default); above 0: sampling, seeded per prompt and sample")
    data.add_argument("--top-k", type=integer, default=20,
                      help="teacher probabilities stored per position (default 20)")
    data.add_argument("--limit", type=integer, default=None, help="only the first N prompts of the file")
    data.add_argument("--batch-size", type=integer, default=8, help="answers generated together (default 8)")
    data.add_argument("--shard-prompts", type=integer, default=64, help="prompts per shard (default 64)")
    data.add_argument("--seed", type=integer, default=0, help="sampling seed (default 0)")
    data.add_argument("--no-progress", action="store_true", help="no progress bar (per-shard lines still print)")
    data.set_defaults(run=run_data_command)


def add_features_parser(subparsers) -> None:
    from cats.cli import add_model_arguments

    parser = subparsers.add_parser(
        "features", help="add the target's final features to a data folder (for feature draft adapters)",
        description="Teacher-forces every sample of a `cats train data` folder through the whole target and writes "
                    "its final normed states (what the lm_head reads) beside each shard; resumes at the first shard "
                    "without them. Load the model in the data's dtype.")
    add_model_arguments(parser)
    parser.add_argument("--data", type=Path, required=True, help="data folder (cats train data)")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(run=run_features_command)


def run_features_command(args: argparse.Namespace) -> int:
    import cats
    from cats.cli import default_model

    model = cats.load(args.model or default_model(), dtype=args.dtype)
    written = make_features(model, args.data, progress=not args.no_progress)
    print(f"{args.data}: final features written for {written} shard(s)")
    return 0


def run_data_command(args: argparse.Namespace) -> int:
    import cats
    from cats.cli import default_model

    config = DataConfig(
        prompts=args.prompts, out=args.out, layers=parse_layers(args.layers), max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens, samples_per_prompt=args.samples_per_prompt,
        temperature=args.temperature, top_k=args.top_k, limit=args.limit, batch_size=args.batch_size,
        shard_prompts=args.shard_prompts, seed=args.seed, progress=not args.no_progress,
    )
    model = cats.load(args.model or default_model(), dtype=args.dtype)
    make_training_data(model, config)
    return 0
