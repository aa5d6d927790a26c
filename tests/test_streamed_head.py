"""The lm_head streamed under a memory plan (`cats.model.streamed_head`): when the planner streams it, what the plan
counts, and that decoding on it is the in-memory model's, token for token."""

from __future__ import annotations

import pytest
import torch

import cats
from cats.config import DraftConfig, GenerationConfig
from cats.draft.layer_skip.stream_order import calibrate_stream_order
from cats.loop.generator import Generator
from cats.methods import make_drafter, memory_needs
from cats.model.streamed_head import StreamedHead, draft_vocabulary, draft_vocabulary_size
from cats.model.weights import budget
from cats.model.weights.budget import STORE_ALIGNMENT, MemoryNeeds, PartSizes, plan_memory
from cats.model.weights.skip_rate import MEMORY_TO_DISK, skip_draft_rate
from tests.conftest import STORIES_GGUF, needs

KIB = 1 << 10


def parts(lm_head: int = 48 * KIB) -> PartSizes:
    """Six 8 KiB layers, a head of ``lm_head`` bytes in 1 KiB rows (0: tied to the 16 KiB embeddings)."""
    return PartSizes(embed=16 * KIB, norm=0, lm_head=lm_head, layers=[8 * KIB] * 6, head_row_bytes=KIB,
                     head_streams=lm_head > 0)


def plan(budget_bytes, agreement=(0.9, 0.8, 0.7, 0.6, 0.3), head_rows=4, sizes=None):
    needs_of = MemoryNeeds(context_tokens=10, min_resident_layers=1, prefetch=1, stream_order=(5, 4, 3, 2, 1),
                           stream_agreement=agreement, head_draft_rows=head_rows, draft_tokens=4)
    return plan_memory(budget_bytes, sizes or parts(), needs_of, kv_bytes=4 * KIB, activation=4 * KIB)


def test_the_planner_streams_the_head_where_the_skip_draft_gains_more_than_the_head_costs():
    """Fixed: embeddings 16 KiB, KV 4, activations 4. Head resident (48 KiB): 72 KiB + 8 per resident layer + 8 per
    buffer (two). Head streamed: its 4 draft rows instead, with room for 8 end-of-sequence rows (12 x (1 KiB + 8 B)),
    and on every pass one read of its other 44 rows (11 pieces of 4, each read from an aligned start: up to 4 KiB
    more). At 100 KiB the resident head leaves one layer resident (96 KiB) and a skip draft that agrees 0.3; streamed,
    five stay (88 KiB + 12 x 1032 B) and the draft skips one layer, agreeing 0.9."""
    rows = 12 * (KIB + 8)
    resident_head = plan(100 * KIB, head_rows=0)
    assert not resident_head.head_streamed and resident_head.streamed == (1, 2, 3, 4, 5)
    streamed = plan(100 * KIB)
    assert streamed.head_streamed and streamed.streamed == (5,) and streamed.resident_layers == 5
    assert streamed.head_chunk_rows == (8 * KIB - STORE_ALIGNMENT) // KIB == 4 and streamed.head_streamed_rows == 44
    assert streamed.head_chunks == 11 and streamed.streamed_units == 12 and streamed.pool_slots == 2
    assert streamed.bytes_per_pass == 8 * KIB + 44 * KIB + 11 * STORE_ALIGNMENT
    assert streamed.planned_bytes == (16 + 4 + 4 + 5 * 8 + 2 * 8) * KIB + rows
    assert skip_draft_rate(streamed) > skip_draft_rate(resident_head)
    text = streamed.describe()
    assert "lm_head rows of the draft vocabulary (4)" in text
    assert "and the lm_head's rows past the draft's (44.0 KiB, in 11 pieces)" in text
    assert streamed.to_dict()["head_streamed"] and streamed.to_dict()["head_chunks"] == 11
    # where the layers the head would free draft badly, the head stays
    poor = plan(100 * KIB, agreement=(0.05, 0.8, 0.7, 0.6, 0.3))
    assert not poor.head_streamed and poor.streamed == (1, 2, 3, 4, 5)
    # a tied head (its bytes are the embeddings') never streams; a budget that keeps every layer streams nothing
    assert not plan(100 * KIB, sizes=parts(lm_head=0)).head_streamed
    assert not plan(200 * KIB).head_streamed and plan(200 * KIB).streamed == ()
    # below the resident head's minimum (one layer: 96 KiB) the streamed head still fits, and names the lower minimum
    small = plan(70 * KIB)
    assert small.head_streamed and small.streamed == (2, 3, 4, 5)
    assert small.minimum == (16 + 4 + 4 + 8 + 2 * 8) * KIB + rows < resident_head.minimum == 96 * KIB


def test_the_skip_draft_rate_counts_the_chain_the_reads_and_the_draft():
    one = plan(100 * KIB)
    count = len(one.streamed)
    a, k = one.needs.stream_agreement[count - 1], one.needs.draft_tokens
    draft = k * (one.resident_layer_bytes + one.draft_rows_bytes) / MEMORY_TO_DISK
    assert skip_draft_rate(one) == pytest.approx(sum(a ** i for i in range(k + 1)) / (draft + one.bytes_per_pass))
    assert skip_draft_rate(plan(200 * KIB)) == 0.0  # nothing streams: no skip draft


def test_the_draft_vocabulary_is_the_lowest_ids_and_the_end_of_sequence():
    assert draft_vocabulary_size(151936) == 32768 and draft_vocabulary_size(512) == 128
    vocab = draft_vocabulary(512, {2, 500})
    assert vocab.tolist() == [*range(128), 500]


@needs(STORIES_GGUF)
@pytest.mark.parametrize("method", ["layer-skip", "dytc"])
def test_decoding_with_the_streamed_head_is_decoding_in_memory(method, monkeypatch, tmp_path):
    """stories260K (an untied F32 head) under a budget that streams two layers of a stream order calibrated here and
    the lm_head: the same tokens as the model in memory, the head read in pieces once per verification pass after
    the layers, the drafts through its resident rows."""
    monkeypatch.setenv("CATS_CACHE", str(tmp_path))
    monkeypatch.setattr(budget, "skip_draft_rate", lambda p: 1.0 + p.head_streamed)  # the mechanics, not the choice
    with pytest.warns(UserWarning, match="tokenizer"):
        resident = cats.load_model(STORIES_GGUF)
    calibrate_stream_order(resident, prompts=[list(range(5, 25)), list(range(40, 70))], tokens=8, width=2)
    prompt, config = list(range(1, 30)), GenerationConfig(max_new_tokens=24)
    plain = Generator(resident).generate(prompt, config).token_ids
    needs_of = memory_needs(resident.config, torch.float32, method, context_tokens=64, prefetch=1, on_blocks=True)
    assert needs_of.head_draft_rows == 128
    for megabytes in (2.0, 1.8, 1.6, 1.4):  # the largest budget that streams a layer besides the head
        with pytest.warns(UserWarning, match="tokenizer"):
            model = cats.load_model(STORIES_GGUF, memory_budget=f"{megabytes}MiB", memory_needs=needs_of)
        plan_of = model.memory_plan
        if plan_of.head_streamed:
            break
        model.close()
    assert plan_of.head_streamed and plan_of.streamed and isinstance(model.hf_model.lm_head, StreamedHead)
    assert model.vocab_size == resident.vocab_size
    drafter = make_drafter(method, model, DraftConfig(num_draft_tokens=3) if method == "layer-skip" else None)
    result = Generator(model, drafter, method=method).generate(prompt, config)
    assert result.token_ids == plain
    counts = result.stats.offload
    assert counts["head_streamed"] and counts["out_of_order"] == 0
    assert counts["acquires"] == plan_of.streamed_units * result.stats.target_forwards  # no draft read a piece
    model.close()
