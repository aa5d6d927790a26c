"""Counters of one generation. Every number a user sees is derived here from raw counts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from cats.draft.dytc.report import summary_text
from cats.model.weights import layer_ranges


@dataclass
class GenerationStats:
    method: str = "ar"
    acceptance: str = "exact"  # "exact" (the target's greedy output / sampling distribution) or "typical (lossy)"
    sampling: str = "greedy"  # "greedy", or the warping and seed, e.g. "temperature 0.7, top-p 0.9, seed 3"
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # the seed used (drawn when none was given), None when greedy
    typical_tau: float | None = None  # typical acceptance only
    typical_alpha: float | None = None
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0  # prefill + one per decode step
    drafted_tokens: int = 0  # tokens proposed by the drafter (nodes and unverified drawn candidates), summed over steps
    accepted_draft_tokens: int = 0  # drafted tokens the acceptance rule kept
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per decode step (accepted + 1)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0
    stop_reason: str = ""
    shallow: dict | None = None  # the cascade's shallow-verifier counters (see cats.verify.cascade), when it ran
    scheduler: dict | None = None  # the DyTC scheduler's decisions and estimates (see cats.draft.dytc.scheduler), when it ran
    offload: dict | None = None  # layer streaming under a memory budget (cats.model.weights.stream counters), when it ran
    peak_rss_mb: float | None = None  # the process's peak resident memory so far (VmHWM), at the end

    def record_sampling(self, acceptance, sampler) -> None:
        """Record the acceptance rule (`cats.verify.acceptance`) and the `cats.sampling.Sampler` of the generation."""
        self.acceptance, self.sampling = acceptance.label, sampler.describe()
        self.temperature, self.top_p, self.top_k, self.seed = (sampler.temperature, sampler.top_p, sampler.top_k,
                                                               sampler.seed)
        if acceptance.name == "typical":
            self.typical_tau, self.typical_alpha = acceptance.tau, acceptance.alpha

    @property
    def lossless(self) -> bool:
        return self.acceptance == "exact"

    @property
    def decode_steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def mean_accepted(self) -> float:
        """Mean tokens committed per decode step (the field's "mean accepted tokens", tau); 1.0 for plain decoding."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens the target kept."""
        return self.accepted_draft_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(
            lossless=self.lossless,
            decode_steps=self.decode_steps,
            mean_accepted=round(self.mean_accepted, 4),
            acceptance_rate=round(self.acceptance_rate, 4),
            tokens_per_s=round(self.tokens_per_s, 3),
        )
        return data

    def summary_line(self) -> str:
        return (
            f"[{self.method}, acceptance: {self.acceptance}{self._typical()}, {self.sampling}] "
            f"{self.new_tokens} tokens in {self.wall_s:.2f} s "
            f"({self.tokens_per_s:.1f} tok/s), {self.target_forwards} target forwards, "
            f"mean accepted {self.mean_accepted:.2f}, draft acceptance {self.acceptance_rate:.1%} "
            f"({self.accepted_draft_tokens}/{self.drafted_tokens}), stop: {self.stop_reason}"
            + (f"; shallow verifier: kept {self.shallow['keep_rate']:.1%} of drafted nodes, precision "
               f"{self.shallow['precision']:.2f}, recall {self.shallow['recall']:.2f}, "
               f"{self.shallow['nodes_corrected']} corrections"
               + (f", {self.shallow['redraft_passes']} redraft passes" if self.shallow.get("redraft_passes") else "")
               if self.shallow else "")
            + (f"; scheduler: {_scheduler_text(self.scheduler)}" if self.scheduler else "")
            + (f"; offload: layers {layer_ranges(self.offload['streamed_layers'])}"
               + (" and the lm_head" if self.offload.get("head_streamed") else "")
               + f" streamed ({self.offload['io']}), "
               f"read {self.offload['bytes_read'] / 2**20:.0f} MiB in "
               f"{self.offload['read_s']:.2f} s"
               + (f" ({self.offload['decode_s']:.2f} s decoding blocks)" if self.offload.get("decode_s") else "")
               + f", stalled {self.offload['stall_s']:.2f} s, "
               f"{self.offload['hidden_fraction']:.0%} of reads hidden behind compute" if self.offload else "")
            + (f"; peak RSS {self.peak_rss_mb:.0f} MiB" if self.peak_rss_mb is not None else "")
        )

    def _typical(self) -> str:
        return f" tau {self.typical_tau:g} alpha {self.typical_alpha:g}" if self.typical_tau is not None else ""


def _scheduler_text(scheduler: dict) -> str:

    return summary_text(scheduler)
