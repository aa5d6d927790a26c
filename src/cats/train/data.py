"""Self-distillation training data: the target answers prompts itself, and per sample we store what an adapter
learns from: token ids, a loss mask over the response, hidden states after chosen layers and the target's top-k
next-token distribution. ``cats train data`` writes a folder; `TrainingData` reads it. The folder format and
its reader are in `cats.train.folder`, the answers and teacher forcing of each sample in `cats.train.teacher`.

Every stored state comes from a teacher-forced forward of the UNPADDED sequence through `LayeredModel`, so it is
exactly what ``forward_layers(embed(ids), 0, L, cache)`` gives; only the answers come from batched generation.

Answers: ``generate`` (self-distillation: the target answers each prompt; decoding, slow on a CPU) or ``given``
(the assistant turn a ShareGPT file holds after each prompt, teacher-forced: one prefill per sample, several times
faster; the targets are still the target's own next-token distribution at every position, only the text it reads is
not its own). ``features=True`` also writes each shard's final features (`cats.train.folder.features_name`) from the
same forward, so feature adapters need no second pass (`make_features`).

Resuming: shards and ``meta.json`` are written under temporary names and renamed, ``meta.json`` after every shard.
A rerun with the same settings skips the shards listed in ``meta.json`` (a killed run loses at most the shard in
progress). ``--limit`` may grow on a rerun (the data is extended; a last, partial shard is made again for its full
prompt range) but not shrink; any other changed setting, or another model, is refused.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cats.errors import InvalidArgumentError, NoTokenizerError
from cats.model.identity import model_identity
from cats.prompts import chat_prompt_ids, read_prompt_file
from cats.train.folder import (
    FORMAT,
    META,
    TrainingData,
    check_same_model,
    check_shards_exist,
    features_name,
    read_meta,
    shard_name,
)
from cats.train.teacher import generate_answers, sample_seed, teacher_forward

HIDDEN_DTYPE = "bfloat16"
# meta.json keys that must be equal for a rerun to continue a folder (the model is compared by fingerprint and the
# prompt file by content, so a moved model or prompt file does not block a resume)
SETTINGS_CHECKED_ON_RESUME = (
    "dtype", "layers", "top_k", "hidden_dtype", "prompts_sha256", "prompt_format", "max_new_tokens",
    "max_prompt_tokens", "samples_per_prompt", "temperature", "seed", "shard_prompts", "answers", "features",
)
# values of settings added later, for folders whose meta.json predates them
SETTING_DEFAULTS = {"answers": "generate", "features": False}
ANSWERS = ("generate", "given")


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
    answers: str = "generate"  # "generate" (the target answers) or "given" (the file's assistant turns, teacher-forced)
    features: bool = False  # also store the final features of every position (for feature adapters)

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
        if self.answers not in ANSWERS:
            raise InvalidArgumentError(f"--answers must be one of {', '.join(ANSWERS)}, got {self.answers!r}")
        if self.answers == "given" and (self.samples_per_prompt != 1 or self.temperature != 0):
            raise InvalidArgumentError("--answers given teacher-forces the one answer the file holds per prompt: it "
                                       "takes neither --samples-per-prompt above 1 nor --temperature")
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
            raise NoTokenizerError(f"model {model.name!r} has no tokenizer; cats train data needs one", model.name)
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
    given = None
    if config.answers == "given":
        given = (prompt_file.answers or [None] * len(texts))[: config.limit]
        if not any(given):
            raise InvalidArgumentError(f"{prompt_file.path} holds no assistant turn after its prompts; --answers given "
                                       "needs ShareGPT entries with a 'gpt' (or 'assistant') turn after the human one")
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
        "answers": config.answers,
        "features": config.features,
    }
    meta = _open_for_writing(out, settings, len(texts))
    prompts, skipped, truncated = _encode_prompts(model, texts, config.max_prompt_tokens)
    answers = _encode_answers(model, given, prompts, skipped, config.max_new_tokens) if given is not None else None
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
            tensors, features = _make_shard(model, config, prompts, answers, prompt_range, bar)
            if features is not None:  # written first: a listed shard always has its features
                _write_features(out, shard_name(index), features)
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


def _encode_answers(model, given: list[str | None], prompts, skipped: list[dict], max_tokens: int) -> list:
    """Token ids of each given answer, at most ``max_tokens`` (None where there is none: the prompt is skipped)."""
    answers = []
    for index, (text, prompt) in enumerate(zip(given, prompts)):
        if prompt is not None and text is None:
            skipped.append({"prompt": index, "reason": "no assistant turn after the prompt"})
            prompts[index] = None
        answers.append(model.tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens] if text else None)
    return answers


def _open_for_writing(out: Path, settings: dict, num_prompts: int) -> dict:
    """A new folder's meta, or the existing one after checking it was made with the same settings."""
    if not (out / META).exists():
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise InvalidArgumentError(f"{out} exists and is not a CATS training-data folder (no {META}); "
                                       "pass a new or empty folder")
        out.mkdir(parents=True, exist_ok=True)
        return {**settings, "num_prompts": num_prompts, "shards": [], "skipped_prompts": [], "truncated_prompts": []}
    meta = read_meta(out)
    check_same_model(meta, settings["model"], out)
    changed = [key for key in SETTINGS_CHECKED_ON_RESUME if meta.get(key, SETTING_DEFAULTS.get(key)) != settings[key]]
    if changed:
        was = ", ".join(f"{key}={meta.get(key)!r}" for key in changed)
        now = ", ".join(f"{key}={settings[key]!r}" for key in changed)
        raise InvalidArgumentError(f"{out} holds data made with {was}, but this run asks for {now}; rerun with the "
                                   "same arguments to continue it, or pass another --out")
    if num_prompts < meta["num_prompts"]:
        raise InvalidArgumentError(f"{out} was started for {meta['num_prompts']} prompts; this run selects only "
                                   f"{num_prompts} (--limit may grow on a rerun, not shrink)")
    check_shards_exist(meta, out)
    shards = meta["shards"]
    if shards and shards[-1]["num_prompts"] < settings["shard_prompts"] and num_prompts > meta["num_prompts"]:
        # the last shard ended at the old --limit: make it again for its full prompt range (its file stays until
        # the new one replaces it; unlisted, it is not part of the data)
        shards.pop()
    return meta


def _make_shard(model, config: DataConfig, prompts, answers, prompt_range: range, bar) -> tuple:
    """Answer every (prompt, sample) of the range (or take its given answer), teacher-force each answer, and pack
    the shard's tensors; also the final features of its positions with ``config.features`` (else None)."""
    jobs = [(p, s) for p in prompt_range if prompts[p] is not None for s in range(config.samples_per_prompt)]
    if bar is not None:
        bar.update(len(prompt_range) - len({p for p, _ in jobs}))  # skipped prompts are done at once
    unfinished = {p: config.samples_per_prompt for p, _ in jobs}
    by_length = sorted(jobs, key=lambda job: (len(prompts[job[0]]), job))  # batches of similar length pad little
    records = {}
    for start in range(0, len(by_length), config.batch_size):
        batch = by_length[start : start + config.batch_size]
        if answers is not None:
            batch_answers = [answers[p] for p, _ in batch]
        else:
            seeds = [sample_seed(config.seed, p, s) for p, s in batch]
            batch_answers = generate_answers(model, [prompts[p] for p, _ in batch], config.max_new_tokens,
                                             config.temperature, seeds)
        for (p, s), answer in zip(batch, batch_answers):
            records[p, s] = teacher_forward(model, prompts[p] + answer, len(prompts[p]), config.layers, config.top_k,
                                            features=config.features)
            unfinished[p] -= 1
            if unfinished[p] == 0 and bar is not None:
                bar.update(1)
    ordered = [records[job] | {"prompt_index": job[0]} for job in jobs]
    features = None
    if config.features:
        features = (torch.cat([r["features"] for r in ordered]) if ordered
                    else torch.zeros(0, model.config.hidden_size, dtype=torch.bfloat16))
    return _pack(ordered, config.layers, model.config.hidden_size, config.top_k), features


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


def _write_shard(out: Path, index: int, tensors: dict[str, torch.Tensor], prompt_range: range) -> dict:
    from safetensors.torch import save_file

    name = shard_name(index)
    temporary = out / (name + ".tmp")
    save_file(tensors, str(temporary), metadata={"format": FORMAT})
    os.replace(temporary, out / name)
    return {"file": name, "first_prompt": prompt_range.start, "num_prompts": len(prompt_range),
            "samples": len(tensors["prompt_lengths"]), "tokens": len(tensors["input_ids"]),
            "response_tokens": int(tensors["loss_mask"].sum())}


def _write_features(out: Path, shard_file: str, features: torch.Tensor) -> None:
    from safetensors.torch import save_file

    name = features_name(shard_file)
    temporary = out / (name + ".tmp")
    save_file({"features": features.contiguous()}, str(temporary), metadata={"format": FORMAT})
    os.replace(temporary, out / name)


def _write_meta(out: Path, meta: dict) -> None:
    temporary = out / (META + ".tmp")
    temporary.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(temporary, out / META)


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
        _write_features(data.path, data.shards[index]["file"],
                        torch.cat(rows) if rows else torch.zeros(0, data.hidden_size, dtype=torch.bfloat16))
    if bar is not None:
        bar.close()
    return len(todo)
