"""The planner's estimate of how fast a skip draft over a plan's streamed layers decodes
(`cats.model.weights.budget.plan_memory` compares the plans with the lm_head resident and streamed by it)."""

from __future__ import annotations

MEMORY_TO_DISK = 10  # bytes read from memory in the time the disk reads one (2 vCPU Zen 4: ~27 GB/s, 2-3.4 GB/s)


def skip_draft_rate(plan) -> float:
    """An estimate of the tokens a skip draft over the streamed layers of ``plan`` (a `MemoryPlan`) commits per unit
    of time: a chain of k = ``needs.draft_tokens`` drafts, each accepted with the calibrated agreement a of the
    streamed set, commits 1 + a + ... + a^k tokens per pass; the pass costs its reads, ``bytes_per_pass``, and k
    draft tokens, each reading the resident layers and the head it reads out through from memory, `MEMORY_TO_DISK`
    times faster (all in disk-byte units). 0 where the order gives no agreement for the streamed set."""
    count, agreements = len(plan.streamed), plan.needs.stream_agreement
    if not 0 < count <= len(agreements):
        return 0.0
    agreement, k = agreements[count - 1], plan.needs.draft_tokens
    tokens = sum(agreement ** i for i in range(k + 1))
    head = plan.draft_rows_bytes if plan.head_streamed else plan.parts.lm_head
    draft = k * (plan.resident_layer_bytes + head) / MEMORY_TO_DISK
    return tokens / (draft + plan.bytes_per_pass)
