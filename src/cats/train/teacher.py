"""The target as its own teacher: batched answers to prompts, each seeded on its own (`sample_seed`,
`SeededSampling`), and the teacher-forced record of one sample (`teacher_forward`) that ``cats train data`` stores."""

from __future__ import annotations

import hashlib
from contextlib import contextmanager

import torch


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
    """Batched ``hf_model.generate`` on left-padded prompts; each answer is cut after its first EOS (inclusive). A
    model without ``generate`` (CATS's own decoder, `cats.model.decoder`: a GGUF file on its blocks) answers one
    prompt at a time on its own forward (`_answer`): the same tokens, each row's sampling its own either way."""
    if not hasattr(model.hf_model, "generate"):
        return [_answer(model, ids, max_new_tokens, SeededSampling([seed], temperature) if temperature > 0 else None)
                for ids, seed in zip(prompts, seeds)]
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


def _answer(model, prompt_ids: list[int], max_new_tokens: int, sampling: SeededSampling | None) -> list[int]:
    """Plain decoding of one answer on the model's forward (greedy, or Gumbel-max under ``sampling``), up to and
    including its first EOS."""
    eos, cache, answer = model.eos_token_ids, model.new_cache(), []
    logits = model.forward(torch.tensor(prompt_ids), cache)[-1:]
    while len(answer) < max_new_tokens:
        scores = logits if sampling is None else sampling(None, logits)
        answer.append(int(scores[0].argmax()))
        if answer[-1] in eos:
            break
        logits = model.forward(torch.tensor(answer[-1:]), cache)[-1:]
    return answer


@torch.inference_mode()
def teacher_forward(model, ids: list[int], prompt_length: int, layers: list[int], top_k: int,
                    features: bool = False) -> dict:
    """One sample's record from a forward of the unpadded sequence: hidden states after each of ``layers``
    (ascending), and the top-k of the final next-token distribution at every position; with ``features``, also the
    final normed states (what the lm_head reads) as ``features``."""
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
    record = {"input_ids": torch.tensor(ids, dtype=torch.long), "prompt_length": prompt_length,
              "loss_mask": loss_mask, "hidden": states, "topk_ids": top.indices.to(torch.int32).cpu(),
              "topk_probs": top.values.to(torch.float16).cpu()}
    if features:
        record["features"] = model.decoder.norm(hidden)[0].to(torch.bfloat16).cpu()
    return record


__all__ = ["SeededSampling", "generate_answers", "pad_token_id", "sample_seed", "teacher_forward"]
