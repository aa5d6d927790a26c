"""``cats train adapter``: train a draft or shallow adapter on self-distillation data, with `accelerate`
(one CPU here; the same command under ``accelerate launch`` on N GPUs).

Loss: soft cross-entropy to the target's top-k next-token distribution (renormalised over the entries inside the
adapter's vocabulary), on a random fraction of the response positions of each batch — the lm_head dominates the
cost, and subsampling buys more optimizer steps (the first trial's finding). AdamW, linear warm-up then cosine
decay, gradient clipping. Checkpoints (accelerate state + our position in the data) every N steps and at each
epoch end; a rerun with the same arguments resumes from the last one.

An EAGLE-3 head (``--arch eagle3``, see `cats.model.eagle3`) trains on the data's states after its three aux layers:
position t gets ``[h_a, h_b, h_c](t)`` and ``e(x_{t+1})`` (its ``fc`` fuses the three in the forward) and learns the
target's distribution at t+1, with no feature regression (EAGLE-3 dropped it). Its training-time test adds a second
step fed the first step's own output, as drafting feeds it (`Eagle3Head.unrolled`), weighted ``--ttt-weight``.

A feature draft adapter (``--input features``, EAGLE-style, see `cats.model.adapter`) trains on the data's final
features (``cats train features``): position t gets ``[f_t, e(x_{t+1})]`` and learns the target's distribution at
t+1 (the token after next), plus ``--feature-loss`` times a smooth-L1 regression of its output to f_{t+1}.
``--input features+hidden`` is the same with the next token's state after ``--layer`` in place of its embedding.

Held-out evaluation (each epoch, and every ``--eval-every`` steps for the learning curve) on data made from prompts
never trained on (MT-Bench first turns answered by the target):
  * agreement: top-1 of the adapter equals the target's top-1, over response positions;
  * overlap: sum_i min(p_i, q_i) over the target's top-k entries (a lower bound of the acceptance probability
    of one drafted token under speculative sampling);
  * expected accepted length of a gamma = 6 chain: from each response position with 6 positions ahead, the number
    of consecutive agreements, capped at 6 (teacher forcing is exact for chains: an agreeing prefix is the true one).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cats.errors import InvalidArgumentError
from cats.model import LayeredModel
from cats.model.adapter import BLOCKS, INITS, INPUTS, ROLES, Adapter, new_adapter
from cats.model.eagle3 import Eagle3Head, default_aux_layers, new_eagle3_head
from cats.train.card import write_model_card
from cats.train.folder import DataMix, TrainingData

GAMMA = 6
SAVE_DTYPES = ("float32", "bfloat16")
MIXED_PRECISIONS = ("no", "bf16")  # accelerate's names: bf16 runs the matrix products under bfloat16 autocast
TTT_WEIGHT = 0.8  # EAGLE-3's decay for the training-time test's second step
ARCHS = ("adapter", "eagle3")  # a CATS adapter (its role and input say which), or an EAGLE-3 head
EAGLE3_ONLY = ("aux_layers", "heads", "kv_heads", "intermediate_size", "ttt_weight")  # TrainConfig fields of --arch eagle3 only


@dataclass
class TrainConfig:
    role: str
    layer: int
    out: Path
    epochs: float = 1.0
    lr: float = 1.5e-3
    batch_tokens: int = 512
    warmup_steps: int = 15
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    position_fraction: float = 0.35
    init: str = "next"
    block: str = "decoder"
    draft_vocab: int | None = None  # reduced vocabulary: the N most frequent response tokens of the training data
    input: str = "hidden"  # "hidden" (state after `layer`), "features" (EAGLE-style; layer = the model's depth) or
    # "features+hidden" (final features + the next token's state after `layer`: early exit with features)
    feature_loss: float = 1.0  # feature adapters: weight of the smooth-L1 regression to the next final feature
    save_dtype: str = "float32"  # dtype of the stored weights (bfloat16: half the bytes)
    mixed_precision: str = "no"  # "bf16": forward and loss under bfloat16 autocast (AMX / bf16 dot products on CPUs
    # that have them); the weights, gradients and optimizer state stay float32
    eval_every: int = 0  # steps between held-out evaluations (0: at epoch ends only)
    checkpoint_every: int = 200
    max_steps: int | None = None
    seed: int = 0
    tensorboard: bool = False
    progress: bool = True
    command: str | None = None  # the command line that started the run, for the model card
    arch: str = "adapter"  # "adapter" or "eagle3" (then role "draft", layer = the model's depth)
    aux_layers: list[int] | None = None  # eagle3: the target layers it reads (default 2, n // 2, n - 3)
    heads: int | None = None  # eagle3: attention heads (default the target's)
    kv_heads: int | None = None  # eagle3: key/value heads (default the target's, at most heads)
    intermediate_size: int | None = None  # eagle3: MLP width (default the target's)
    ttt_weight: float | None = None  # eagle3: weight of the training-time test's second step (default 0.8; 0: off)

    def validate(self, model: LayeredModel, data: TrainingData | DataMix) -> None:
        if self.arch not in ARCHS:
            raise InvalidArgumentError(f"--arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.arch == "eagle3":
            self._validate_eagle3(model, data)
        else:
            given = [name for name in EAGLE3_ONLY if getattr(self, name) is not None]
            if given:
                raise InvalidArgumentError(f"--{given[0].replace('_', '-')} is a setting of --arch eagle3")
            self._validate_adapter(model, data)
        if self.epochs <= 0 or self.lr <= 0 or self.batch_tokens < 1 or not 0 < self.position_fraction <= 1:
            raise InvalidArgumentError("--epochs, --lr and --batch-tokens must be positive and --position-fraction in (0, 1]")
        if model.dtype not in (torch.float32, torch.float64):
            raise InvalidArgumentError(f"train adapters on a float32 model (this one is {model.dtype}); "
                                       "the adapter is converted to the decoding dtype when loaded")
        if self.mixed_precision not in MIXED_PRECISIONS:
            raise InvalidArgumentError(f"--mixed-precision must be one of {', '.join(MIXED_PRECISIONS)}, got "
                                       f"{self.mixed_precision!r}")
        if self.save_dtype not in SAVE_DTYPES:
            raise InvalidArgumentError(f"--save-dtype must be one of {', '.join(SAVE_DTYPES)}, got {self.save_dtype!r}")
        if self.draft_vocab is not None and not 1 <= self.draft_vocab <= model.vocab_size:
            raise InvalidArgumentError(f"--draft-vocab must lie in [1, {model.vocab_size}], got {self.draft_vocab}")

    def _validate_eagle3(self, model: LayeredModel, data: TrainingData | DataMix) -> None:
        if self.role != "draft" or self.layer != model.num_layers or self.input != "hidden":
            raise InvalidArgumentError("an EAGLE-3 head drafts from its aux layers: --role, --layer and --input do "
                                       "not apply to --arch eagle3")
        aux = self.aux_layers or default_aux_layers(model.num_layers)
        missing = [layer for layer in aux if layer not in data.layers]
        if missing:
            raise InvalidArgumentError(f"the training data holds hidden states of layers {data.layers}, not of "
                                       f"{missing}; make data with --layers {','.join(map(str, aux))} or pass "
                                       "--aux-layers among them")
        for name in ("heads", "kv_heads", "intermediate_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidArgumentError(f"--{name.replace('_', '-')} must be positive")
        if self.ttt_weight is None:
            self.ttt_weight = TTT_WEIGHT
        if self.ttt_weight < 0:
            raise InvalidArgumentError(f"--ttt-weight must be >= 0, got {self.ttt_weight}")

    def _validate_adapter(self, model: LayeredModel, data: TrainingData | DataMix) -> None:
        if self.role not in ROLES:
            raise InvalidArgumentError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.init not in INITS or self.block not in BLOCKS:
            raise InvalidArgumentError(f"--init must be one of {', '.join(INITS)} and --block one of {', '.join(BLOCKS)}")
        if self.input not in INPUTS:
            raise InvalidArgumentError(f"--input must be one of {', '.join(INPUTS)}, got {self.input!r}")
        if self.input != "hidden":
            if self.role != "draft":
                raise InvalidArgumentError(f"a feature adapter (--input {self.input}) drafts: use --role draft")
            if self.input == "features" and self.layer != model.num_layers:
                raise InvalidArgumentError(f"a feature adapter drafts from the features after all layers: use "
                                           f"--role draft --layer {model.num_layers}")
            if not data.has_features:
                raise InvalidArgumentError(f"{data.path} has no final features; run `cats train features --data "
                                           f"{data.path}` first")
            if self.feature_loss < 0:
                raise InvalidArgumentError(f"--feature-loss must be >= 0, got {self.feature_loss}")
        reads_layer = self.input != "features"  # the final features alone need no layer's states
        if reads_layer and not 1 <= self.layer < model.num_layers:
            raise InvalidArgumentError(f"--layer {self.layer} is outside [1, {model.num_layers})")
        if reads_layer and self.layer not in data.layers:
            raise InvalidArgumentError(f"the training data holds hidden states of layers {data.layers}, not of layer "
                                       f"{self.layer}; make data with --layers including {self.layer}")


# ---------------------------------------------------------------------------------------------------------- batches
def make_batches(data: TrainingData | DataMix, batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Shuffle the samples and group consecutive ones until a group holds ``batch_tokens`` tokens."""
    order = list(range(data.num_samples))
    rng.shuffle(order)
    batches, current, tokens = [], [], 0
    for index in order:
        current.append(index)
        tokens += data.sample_length(index)
        if tokens >= batch_tokens:
            batches.append(current)
            current, tokens = [], 0
    if current:
        batches.append(current)
    return batches


def load_sample(data: TrainingData | DataMix, index: int, layer: int, adapter: Adapter | Eagle3Head) -> dict:
    """Sample ``index`` as the adapter reads it: ``hidden[layer]`` is its input. For a feature adapter the sample
    is shifted by one: position t holds ``[f_t, e(x_{t+1})]``, its teacher is the target's distribution at t+1,
    and ``next_features`` [T-1, H] holds f_{t+1}. For an EAGLE-3 head likewise, position t holding its three aux
    states and ``e(x_{t+1})`` ``[4H]``."""
    if isinstance(adapter, Eagle3Head):
        aux = adapter.feature_layers
        sample = data.sample(index, layers=list(aux))
        states, ids = sample.pop("hidden"), sample["input_ids"]
        dtype = adapter.fc.weight.dtype
        with torch.no_grad():
            embedded = adapter.target.hf_model.get_input_embeddings()(ids[1:]).to(dtype)
        inputs = torch.cat([states[i][:-1].to(dtype) for i in aux] + [embedded], dim=-1)
        return {**sample, "input_ids": ids[1:], "loss_mask": sample["loss_mask"][1:], "hidden": {layer: inputs},
                "topk_ids": sample["topk_ids"][1:], "topk_probs": sample["topk_probs"][1:]}
    if adapter.fc is None:
        return data.sample(index, layers=[layer])
    hybrid = adapter.config.input == "features+hidden"  # the next token's state after layer L, not its embedding
    sample = data.sample(index, layers=[layer] if hybrid else [], features=True)
    features, ids = sample.pop("features"), sample["input_ids"]
    next_tokens = sample.pop("hidden")[layer][1:] if hybrid else ids[1:]
    with torch.no_grad():
        inputs = adapter.feature_inputs(features[:-1].to(adapter.fc.weight.dtype), next_tokens)
    return {**sample, "input_ids": ids[1:], "loss_mask": sample["loss_mask"][1:], "hidden": {layer: inputs},
            "topk_ids": sample["topk_ids"][1:], "topk_probs": sample["topk_probs"][1:], "next_features": features[1:]}


@dataclass
class Batch:
    hidden: torch.Tensor  # [B, T, H] target states after layer L (right-padded)
    attention_mask: torch.Tensor  # [B, 1, T, T] additive causal mask with key padding
    positions: torch.Tensor  # [P, 2] (row, column) of the response positions that carry a loss
    teacher_ids: torch.Tensor  # [P, K] adapter-vocabulary indices of the target's top-k (-1: outside it)
    teacher_probs: torch.Tensor  # [P, K] the target's probabilities of those entries
    teacher_top1: torch.Tensor  # [P] the target's most likely token id
    next_features: torch.Tensor | None = None  # [P, H] feature adapters: the target's final feature f_{t+1}


def collate(samples: list[dict], layer: int, vocab_index: torch.Tensor | None, dtype, device, kind_window: int | None) -> Batch:
    lengths = [s["input_ids"].numel() for s in samples]
    width = max(lengths)
    hidden = torch.zeros(len(samples), width, samples[0]["hidden"][layer].shape[-1], dtype=dtype)
    visible = torch.zeros(len(samples), width, width, dtype=torch.bool)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    if kind_window:
        steps = torch.arange(width)
        causal &= (steps[:, None] - steps[None, :]) < kind_window
    rows, cols, ids, probs, targets = [], [], [], [], []
    for row, (sample, length) in enumerate(zip(samples, lengths)):
        hidden[row, :length] = sample["hidden"][layer].to(dtype)
        visible[row, :length, :length] = causal[:length, :length]
        visible[row, length:, 0] = True  # padding queries see one key, so no row is fully masked
        where = sample["loss_mask"].nonzero().flatten()
        rows.append(torch.full_like(where, row))
        cols.append(where)
        ids.append(sample["topk_ids"][where])
        probs.append(sample["topk_probs"][where].float())
        if "next_features" in sample:
            targets.append(sample["next_features"][where].to(dtype))
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)[:, None]
    teacher_ids, teacher_probs = torch.cat(ids), torch.cat(probs)
    top1 = teacher_ids[:, 0].clone()
    if vocab_index is not None:
        teacher_ids = vocab_index[teacher_ids]
    next_features = torch.cat(targets).to(device) if targets else None
    return Batch(hidden.to(device), mask.to(device), torch.stack([torch.cat(rows), torch.cat(cols)], 1),
                 teacher_ids.to(device), teacher_probs.to(device), top1.to(device), next_features)


def soft_cross_entropy(logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """Mean over positions of -sum_k p_k log q(id_k), p renormalised over the entries inside the vocabulary
    (ids -1 are outside it); positions with no entry inside are skipped."""
    inside = teacher_ids >= 0
    weights = teacher_probs * inside
    total = weights.sum(-1, keepdim=True)
    keep = total.squeeze(-1) > 0
    log_q = torch.log_softmax(logits.float(), -1).gather(-1, teacher_ids.clamp(min=0))
    per_position = -(weights / total.clamp(min=1e-12) * log_q).sum(-1)
    return per_position[keep].mean() if keep.any() else logits.sum() * 0


# ---------------------------------------------------------------------------------------------------------- metrics
@torch.no_grad()
def evaluate(adapter: Adapter | Eagle3Head, data: TrainingData, layer: int, vocab_index, device, batch_tokens: int = 4096) -> dict:
    """Held-out agreement, top-k overlap and expected accepted length of a gamma-6 chain (see module doc)."""
    adapter.eval()
    agree_total, overlap_total, positions, chain_lengths = 0, 0.0, 0, []
    batches = make_batches(data, batch_tokens, random.Random(0))
    for indices in batches:
        samples = [load_sample(data, i, layer, adapter) for i in indices]
        batch = collate(samples, layer, vocab_index, adapter.norm.weight.dtype, device, _window(adapter))
        normed = adapter(batch.hidden, attention_mask=batch.attention_mask)
        logits = adapter.logits(normed[batch.positions[:, 0], batch.positions[:, 1]]).float()
        predicted = adapter.token_ids(logits.argmax(-1))
        agree = predicted == batch.teacher_top1
        q = torch.softmax(logits, -1).gather(-1, batch.teacher_ids.clamp(min=0)) * (batch.teacher_ids >= 0)
        overlap_total += float(torch.minimum(batch.teacher_probs, q).sum())
        agree_total += int(agree.sum())
        positions += agree.numel()
        start = 0
        for sample in samples:  # chains run along each sample's response positions
            count = int(sample["loss_mask"].sum())
            chain_lengths.extend(chain_accept_lengths(agree[start : start + count].tolist(), GAMMA))
            start += count
    adapter.train()
    return {
        "agreement": agree_total / max(positions, 1),
        "overlap": overlap_total / max(positions, 1),
        f"expected_accepted_gamma{GAMMA}": sum(chain_lengths) / max(len(chain_lengths), 1),
        "positions": positions,
    }


def chain_accept_lengths(agreements: list[bool], gamma: int) -> list[int]:
    """For every start with ``gamma`` positions ahead, the number of consecutive agreements from it (<= gamma).

    >>> chain_accept_lengths([True, True, False, True], 2)
    [2, 1, 0]
    """
    return [next((j for j in range(gamma) if not agreements[s + j]), gamma) for s in range(len(agreements) - gamma + 1)]


def _window(adapter: Adapter | Eagle3Head) -> int | None:
    return adapter.target.sliding_window if getattr(adapter, "kind", None) == "sliding_attention" else None


# ---------------------------------------------------------------------------------------------------------- training
def reduced_vocabulary(data: TrainingData | DataMix, size: int, vocab_size: int) -> list[int]:
    counts = data.response_token_counts(vocab_size)
    return counts.argsort(descending=True, stable=True)[:size].tolist()


def train_adapter(model: LayeredModel, data: TrainingData | DataMix, config: TrainConfig,
                  eval_data: TrainingData | None = None) -> Path:
    """Train; write the adapter folder ``config.out`` (and checkpoints under ``config.out/checkpoint``)."""
    from accelerate import Accelerator
    from tqdm import tqdm

    config.validate(model, data)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(log_with="tensorboard" if config.tensorboard else None, project_dir=str(out))
    device = accelerator.device
    vocab = reduced_vocabulary(data, config.draft_vocab, model.vocab_size) if config.draft_vocab else None
    vocab_index = None
    if vocab is not None:
        vocab_index = torch.full((model.vocab_size,), -1, dtype=torch.long)
        vocab_index[torch.tensor(vocab)] = torch.arange(len(vocab))
    torch.manual_seed(config.seed)
    if config.arch == "eagle3":
        adapter = new_eagle3_head(model, config.aux_layers, heads=config.heads, kv_heads=config.kv_heads,
                                  intermediate_size=config.intermediate_size, vocab_subset=vocab)
    else:
        adapter = new_adapter(model, config.role, config.layer, block=config.block, init=config.init,
                              vocab_subset=vocab, input=config.input)
    adapter.train()
    batches_per_epoch = len(make_batches(data, config.batch_tokens, random.Random(config.seed)))
    total_steps = max(1, math.ceil(batches_per_epoch * config.epochs / accelerator.num_processes))
    if config.max_steps:
        total_steps = min(total_steps, config.max_steps)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)

    def schedule(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    wrapped, optimizer, scheduler = accelerator.prepare(adapter, optimizer, scheduler)
    accelerator.register_for_checkpointing(scheduler)
    state = _resume(accelerator, out, config, data)
    if config.tensorboard:
        accelerator.init_trackers("cats-adapter")
    started = time.perf_counter() - state["wall_s"]
    bar = tqdm(total=total_steps, initial=state["step"], disable=not config.progress or not accelerator.is_main_process,
               desc=config.arch if config.arch != "adapter" else f"{config.role}@{config.layer}")
    rng_positions = torch.Generator().manual_seed(config.seed + state["step"])
    window = _window(adapter)
    while state["step"] < total_steps:
        epoch = state["epoch"]
        batches = make_batches(data, config.batch_tokens, random.Random(config.seed + epoch))
        batches = batches[accelerator.process_index :: accelerator.num_processes]
        for batch_number in range(state["batch"], len(batches)):
            if state["step"] >= total_steps:
                break
            samples = [load_sample(data, i, config.layer, adapter) for i in batches[batch_number]]
            batch = collate(samples, config.layer, vocab_index, model.dtype, device, window)
            chosen = torch.rand(batch.positions.shape[0], generator=rng_positions) < config.position_fraction
            if not chosen.any():
                chosen[0] = True
            # autocast here, not accelerate's mixed_precision: its state is one per process, and the read-out runs
            # outside the wrapped module
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.mixed_precision == "bf16"):
                logits, loss = _loss(adapter, wrapped, batch, chosen, config, device)
            accelerator.backward(loss)
            if config.grad_clip:
                accelerator.clip_grad_norm_(wrapped.parameters(), config.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            with torch.no_grad():
                agree = float((adapter.token_ids(logits.argmax(-1)) == batch.teacher_top1[chosen.to(device)]).float().mean())
            state["step"] += 1
            state["batch"] = batch_number + 1
            state["train_tokens"] += int(sum(s["input_ids"].numel() for s in samples))
            state["losses"].append(round(float(loss.detach()), 5))
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", agree=f"{agree:.2f}")
            if config.tensorboard:
                accelerator.log({"train/loss": float(loss.detach()), "train/agreement": agree}, step=state["step"])
            if config.eval_every and eval_data is not None and state["step"] % config.eval_every == 0:
                _record_eval(state, adapter, eval_data, config, vocab_index, device, accelerator, started)
            if config.checkpoint_every and state["step"] % config.checkpoint_every == 0:
                _checkpoint(accelerator, out, state, started)
        else:
            state["epoch"], state["batch"] = epoch + 1, 0
            if eval_data is not None:
                _record_eval(state, adapter, eval_data, config, vocab_index, device, accelerator, started)
            _checkpoint(accelerator, out, state, started)
    bar.close()
    if eval_data is not None and (not state["curve"] or state["curve"][-1]["step"] != state["step"]):
        _record_eval(state, adapter, eval_data, config, vocab_index, device, accelerator, started)
    state["wall_s"] = time.perf_counter() - started
    if accelerator.is_main_process:
        final = accelerator.unwrap_model(wrapped)
        final.config.training = {
            "data": str(data.path), "data_samples": data.num_samples, "data_response_tokens": data.num_response_tokens,
            "eval_data": str(eval_data.path) if eval_data is not None else None,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
            "steps": state["step"], "train_tokens": state["train_tokens"], "wall_s": round(state["wall_s"], 1),
            "processes": accelerator.num_processes,
            "final_eval": state["curve"][-1] if state["curve"] else None, "learning_curve": state["curve"],
            "command": config.command,
        }
        final.save(out, dtype=getattr(torch, config.save_dtype))
        write_model_card(out)
    if config.tensorboard:
        accelerator.end_training()
    return out


def _loss(adapter, wrapped, batch: Batch, chosen: torch.Tensor, config: TrainConfig, device) -> tuple:
    """The chosen positions' logits and the step's loss: soft cross-entropy to the teacher, plus an EAGLE-3 head's
    training-time test step, plus a feature adapter's regression to the next feature."""
    where = batch.positions[chosen]
    second = None
    if isinstance(adapter, Eagle3Head) and config.ttt_weight:  # its own output fed back: a second step
        normed, second = wrapped(batch.hidden, attention_mask=batch.attention_mask, unroll=True)
    else:
        normed = wrapped(batch.hidden, attention_mask=batch.attention_mask)
    logits = adapter.logits(normed[where[:, 0], where[:, 1]])
    loss = soft_cross_entropy(logits, batch.teacher_ids[chosen.to(device)], batch.teacher_probs[chosen.to(device)])
    if second is not None:  # step two at t predicts the teacher at t + 1
        later = chosen & (batch.positions[:, 1] >= 1)
        if later.any():
            rows = batch.positions[later]
            step_two = adapter.logits(second[rows[:, 0], rows[:, 1] - 1])
            loss = loss + config.ttt_weight * soft_cross_entropy(
                step_two, batch.teacher_ids[later.to(device)], batch.teacher_probs[later.to(device)])
    if batch.next_features is not None and config.feature_loss:  # regression on every loss position
        every = batch.positions
        loss = loss + config.feature_loss * torch.nn.functional.smooth_l1_loss(
            normed[every[:, 0], every[:, 1]].float(), batch.next_features.float())
    return logits, loss


def _record_eval(state, adapter, eval_data, config, vocab_index, device, accelerator, started) -> None:
    metrics = evaluate(adapter, eval_data, config.layer, vocab_index, device)
    point = {"step": state["step"], "epoch": state["epoch"], "train_tokens": state["train_tokens"],
             "wall_s": round(time.perf_counter() - started, 1), **{k: round(v, 4) for k, v in metrics.items()}}
    state["curve"].append(point)
    if accelerator.is_main_process:
        print(f"eval step {point['step']}: agreement {point['agreement']:.3f}, overlap {point['overlap']:.3f}, "
              f"E[accepted] gamma6 {point[f'expected_accepted_gamma{GAMMA}']:.2f}", flush=True)
    if config.tensorboard:
        accelerator.log({f"eval/{k}": v for k, v in metrics.items()}, step=state["step"])


def _checkpoint_settings(config: TrainConfig, data: TrainingData | DataMix) -> dict:
    settings = {k: v for k, v in asdict(config).items() if k not in ("out", "progress", "tensorboard", "eval_every",
                                                                      "checkpoint_every", "max_steps", "command",
                                                                      "save_dtype")}
    settings["data_fingerprint"] = data.meta["model"]["fingerprint"]
    settings["data_samples"] = data.num_samples
    return settings


def _resume(accelerator, out: Path, config: TrainConfig, data: TrainingData | DataMix) -> dict:
    folder = out / "checkpoint"
    fresh = {"step": 0, "epoch": 0, "batch": 0, "train_tokens": 0, "losses": [], "curve": [], "wall_s": 0.0,
             "settings": _checkpoint_settings(config, data)}
    if not (folder / "cats-state.json").is_file():
        return fresh
    saved = json.loads((folder / "cats-state.json").read_text())
    if saved["settings"] != fresh["settings"]:
        raise InvalidArgumentError(f"{folder} holds a checkpoint of a run with other settings or data; "
                                   "use another --out or delete it")
    accelerator.load_state(str(folder))
    print(f"resuming from step {saved['step']} (epoch {saved['epoch']})", flush=True)
    return saved


def _checkpoint(accelerator, out: Path, state: dict, started: float) -> None:
    folder = out / "checkpoint"
    accelerator.save_state(str(folder))
    if accelerator.is_main_process:
        state["wall_s"] = time.perf_counter() - started
        temporary = folder / "cats-state.json.tmp"
        temporary.write_text(json.dumps(state))
        temporary.replace(folder / "cats-state.json")

