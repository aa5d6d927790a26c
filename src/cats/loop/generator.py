"""THE decode loop: draft -> verify -> accept -> roll back, one readable step at a time.

The loop does not know which drafter it runs: a drafter returns a `Proposal`, the target scores it in one
forward, an acceptance rule returns a `Verdict`, and the cache is cut back to the committed tokens.

Greedy (temperature 0) or sampled (temperature > 0, top-p, top-k, seed): one `Sampler` per generation makes
every token choice and random draw; the acceptance rule (`cats.verify.acceptance`) keeps the output exactly plain
greedy decoding or plain sampling, unless typical acceptance (lossy) is asked for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from cats.config import GenerationConfig
from cats.draft.base import DecodeState, Drafter, Proposal
from cats.errors import InvalidArgumentError, PromptTooLongError
from cats.loop.stats import GenerationStats
from cats.loop.text import StopStrings
from cats.model import LayeredModel
from cats.model.weights.rss import page_cache_bytes, peak_rss_bytes
from cats.model.weights.transient import prompt_chunk
from cats.prompts import check_token_ids
from cats.sampling import Sampler
from cats.verify.acceptance import TYPICAL_NEEDS_DRAFTS, make_acceptance
from cats.verify.scorer import TargetScorer

DRAFT_SLACK = 64  # cache slots preallocated beyond prompt + max_new_tokens for draft tokens in flight


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens, including a final EOS if one was generated (as transformers returns them)
    prompt_token_ids: list[int]
    text: str
    stats: GenerationStats = field(default_factory=GenerationStats)

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_token_ids": self.prompt_token_ids,
                "stats": self.stats.to_dict()}


class Generator:
    """Decodes one sequence at a time with an optional drafter (``None``: plain autoregressive decoding).

    ``acceptance``: a rule object (`cats.verify.acceptance`) used for every generation; None (the default) picks the rule
    from each `GenerationConfig` (greedy, speculative sampling or typical)."""

    def __init__(self, model: LayeredModel, drafter: Drafter | None = None, acceptance=None, method: str | None = None,
                 scorer=None):
        self.model = model
        self.drafter = drafter
        self.scorer = scorer or TargetScorer()
        self.acceptance = acceptance
        self.method = method or (drafter.name if drafter else "ar")

    @torch.inference_mode()
    def stream(self, prompt_ids: Sequence[int], config: GenerationConfig, stats: GenerationStats) -> Iterator[list[int]]:
        """Yield the new tokens as they are committed, a chunk per target forward; fill ``stats``."""
        config.validate()
        model = self.model
        prompt_ids = check_token_ids(prompt_ids, model.vocab_size)
        if not prompt_ids:
            raise InvalidArgumentError("the prompt is empty")
        if len(prompt_ids) >= model.context_length:
            raise PromptTooLongError(
                f"prompt has {len(prompt_ids)} tokens but the model's context window is {model.context_length}; "
                "shorten the prompt"
            )
        plan = model.memory_plan
        # a generation ends where the context window is full, whatever max_new_tokens allows
        if plan is not None and min(len(prompt_ids) + config.max_new_tokens, model.context_length) > plan.needs.context_tokens:
            raise InvalidArgumentError(
                f"the memory plan reserved KV cache for {plan.needs.context_tokens} tokens, but the prompt "
                f"({len(prompt_ids)}) plus max_new_tokens ({config.max_new_tokens}) need more; load the model with "
                "a larger context (MemoryNeeds.context_tokens, --max-context)")
        streamed_before = model.weights.snapshot() if model.weights is not None else None
        eos = set() if config.ignore_eos else (config.eos_token_ids if config.eos_token_ids is not None else model.eos_token_ids)
        stop_check = StopStrings(model.tokenizer, config.stop) if config.stop else None
        acceptance = self.acceptance or make_acceptance(config.acceptance, config.temperature, config.typical_tau,
                                                        config.typical_alpha)
        if acceptance.name == "typical" and self.drafter is None:
            raise InvalidArgumentError(TYPICAL_NEEDS_DRAFTS)
        sampler = Sampler(config.temperature, config.top_p, config.top_k, config.seed)
        if acceptance.draws_drafts and sampler.greedy:
            raise InvalidArgumentError(f"acceptance rule {acceptance.name!r} samples: set temperature > 0")
        stats.method, stats.prompt_tokens = self.method, len(prompt_ids)
        stats.record_sampling(acceptance, sampler)
        start = time.perf_counter()

        # 1. prefill: the whole prompt in one forward; its last row gives the first new token (pending, uncached)
        extra_layers = (self.drafter.cache_layers if self.drafter else 0) + self.scorer.cache_layers
        committed = min(len(prompt_ids) + config.max_new_tokens, model.context_length)
        if plan is None:
            capacity = committed + DRAFT_SLACK
        else:  # exactly what the plan reserved: a doubled buffer would break the budget
            capacity = max(plan.needs.context_tokens + plan.needs.max_tree_tokens, committed + 1)
        cache = model.new_cache(extra_layers=extra_layers, capacity=capacity)
        state = DecodeState(model, cache, list(prompt_ids), len(prompt_ids),
                            sampler=sampler if acceptance.draws_drafts else None)
        if self.drafter is not None and self.drafter.wants_features:  # layers the verification keeps states of
            state.layer_hidden = {layer: None for layer in self.drafter.feature_layers}
        prefill_logits = self._prefill(state)
        if self.drafter is not None and self.drafter.wants_target_logits:
            self.drafter.take_target_logits(torch.tensor(prompt_ids[-1:]), prefill_logits[None])
        first = sampler.next_token(prefill_logits, position=len(prompt_ids))
        state.token_ids.append(first)
        stats.target_forwards, stats.prefill_s = 1, time.perf_counter() - start
        chunk, reason = self._commit([first], stats, eos, config, stop_check)
        yield chunk

        while not reason:
            committed = state.committed_length
            if committed >= model.context_length:
                reason = "context_length"
                break
            budget = min(config.max_new_tokens - stats.new_tokens, model.context_length - committed) - 1
            # 2. draft up to `budget` tokens after the pending token x
            tick = time.perf_counter()
            proposal = self.drafter.propose(state, budget) if self.drafter and budget > 0 else Proposal.empty()
            tock = time.perf_counter()
            # 3. verify [x, d_1..d_k] with the full target in one forward (the cascade may prune and extend it first)
            verified, target_logits = self.scorer.score(state, proposal, max_tokens=budget)
            if self.drafter is not None and self.drafter.wants_target_logits:  # every verified row, accepted or not
                self.drafter.take_target_logits(torch.cat([torch.tensor(state.token_ids[-1:]), verified.tokens]),
                                                target_logits)
            # 4. accept (the token after x is at sequence position len(token_ids))
            sampler.position = len(state.token_ids)
            verdict = acceptance.accept(verified, target_logits, sampler)
            del target_logits  # [k+1, V]: not held while the next pass computes its own
            # 5. roll back: keep x and the accepted drafts in every layer; the new token is pending
            accepted = verdict.accepted
            if accepted == list(range(len(accepted))):  # a prefix of the drafted order: cut the rest off
                state.cache.crop(committed + 1 + len(accepted))
            else:  # a tree path: move its slots into place behind x
                state.cache.keep(torch.cat([torch.arange(committed + 1), committed + 1 + torch.tensor(accepted)]))
            new_tokens = verified.tokens[accepted].tolist() + [verdict.next_token]
            state.token_ids.extend(new_tokens)
            if self.drafter:
                if self.drafter.wants_features:  # the target's final states of x and the accepted drafts
                    rows = torch.tensor([0] + [1 + i for i in accepted])
                    self.drafter.take_features(state.final_hidden[rows],
                                               {layer: kept[rows] for layer, kept in state.layer_hidden.items()})
                self.drafter.observe(proposal, verdict.num_accepted)
            stats.draft_s += tock - tick
            stats.verify_s += time.perf_counter() - tock
            stats.target_forwards += 1
            stats.drafted_tokens += proposal.num_candidates
            stats.accepted_draft_tokens += verdict.num_accepted
            chunk, reason = self._commit(new_tokens, stats, eos, config, stop_check)
            stats.accept_lengths.append(len(chunk))
            yield chunk
        stats.stop_reason = reason
        stats.shallow = self.scorer.counters()
        stats.scheduler = self.drafter.counters() if self.drafter is not None else None
        stats.wall_s = time.perf_counter() - start
        if streamed_before is not None:
            stats.offload = offload_counters(model, streamed_before)
        stats.peak_rss_mb = _peak_rss_mb()

    def _prefill(self, state: DecodeState) -> torch.Tensor:
        """Run the prompt through all layers (stopping at the layers whose states the drafter wants) and return
        the target's logits ``[V]`` for the first new token; the lm_head runs on the last position only. Where the
        memory plan prices the prompt in chunks (`MemoryNeeds.prompt_chunk`: no layer's states wanted), it runs
        that many tokens a forward, each after the ones before it in the cache: the same logits and cache (the
        kernels are row-invariant), one more sweep of the streamed layers per chunk."""
        model, plan = self.model, self.model.memory_plan
        components = ([self.drafter] if self.drafter else []) + [self.scorer]
        wanted = sorted({layer for component in components for layer in component.prefill_layers})
        chunk = prompt_chunk(plan.needs) if plan is not None and not wanted else 0
        if chunk:
            for begin in range(0, len(state.token_ids), chunk):
                tokens = torch.tensor(state.token_ids[begin: begin + chunk])
                hidden = model.forward_layers(model.embed(tokens), 0, model.num_layers, state.cache)
            return model.head(hidden[0, -1])
        hidden, start, captured = model.embed(torch.tensor(state.token_ids)), 0, {}
        for stop in sorted(set(wanted) | {model.num_layers}):
            hidden = model.forward_layers(hidden, start, stop, state.cache)
            captured[stop], start = hidden, stop
        for component in components:
            if component.prefill_layers:
                component.prefill(state, captured)
        return model.head(hidden[0, -1])

    def _commit(self, tokens, stats, eos, config, stop_check) -> tuple[list[int], str]:
        """Cut a chunk at EOS, the token limit or a stop string; return it and the stop reason ('' = go on)."""
        reason = ""
        for i, token in enumerate(tokens):
            if token in eos:
                tokens, reason = tokens[: i + 1], "eos"
                break
            if stats.new_tokens + i + 1 >= config.max_new_tokens:
                tokens, reason = tokens[: i + 1], "max_new_tokens"
                break
        if stop_check is not None:
            cut = stop_check.find(tokens)
            if cut is not None:
                tokens, reason = tokens[:cut], "stop_string"
        stats.new_tokens += len(tokens)
        return tokens, reason

    def generate(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        config = config or GenerationConfig()
        if not isinstance(config, GenerationConfig):
            raise InvalidArgumentError(f"config must be a GenerationConfig, got {type(config).__name__}")
        if on_tokens is not None and not callable(on_tokens):
            raise InvalidArgumentError(f"on_tokens must be a function of the new token ids, got {on_tokens!r}")
        stats, new_tokens = GenerationStats(), []
        for chunk in self.stream(prompt_ids, config, stats):
            new_tokens.extend(chunk)
            if on_tokens is not None and chunk:
                on_tokens(chunk)
        tokenizer = self.model.tokenizer
        text = tokenizer.decode(new_tokens, skip_special_tokens=True) if tokenizer is not None else ""
        return GenerationResult(new_tokens, check_token_ids(prompt_ids), text, stats)


def offload_counters(model: LayeredModel, before) -> dict:
    """The streamer's counters since ``before``, with what streamed and how."""
    weights = model.weights
    counters = weights.snapshot().minus(before).to_dict()
    plan = model.memory_plan
    counters.update(streamed_layers=list(plan.streamed), head_streamed=plan.head_streamed, io=weights.io,
                    store_page_cache_mb=round(page_cache_bytes(weights.store_files()) / 2**20, 2))
    return counters


def _peak_rss_mb() -> float | None:
    peak = peak_rss_bytes()
    return round(peak / 2**20, 1) if peak is not None else None

