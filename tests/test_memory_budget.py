"""Budget parsing, the planner's arithmetic on a hand-computed case, the below-minimum error, the per-method needs,
and the speculation bucket chosen from hand-made I/O and compute times."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from cats.errors import InvalidArgumentError
from cats.model.weights.budget import BudgetTooSmallError, MemoryNeeds, PartSizes, parse_budget, plan_memory
from cats.model.weights.transient import PROMPT_CHUNK, kv_cache_bytes, prompt_forward_tokens, prompt_text
from cats.draft.sizing import BUCKETS, choose_bucket, streamed_pass_s
from tests.conftest import tiny_config, tiny_model
from cats.config import DraftConfig
from cats.method_needs import HeldAs
from cats.methods import memory_needs
from cats.model.adapter import new_adapter
from cats.model.weights.offload import plan_for

KIB, MIB = 1 << 10, 1 << 20


def test_parse_budget():
    assert parse_budget("300MiB", 0) == 300 * MIB
    assert parse_budget("1.5GB", 0) == 1_500_000_000
    assert parse_budget(" 2 GiB ", 0) == 2 << 30
    assert parse_budget("512m", 0) == 512 * MIB  # bare letters are binary
    assert parse_budget("64KB", 0) == 64_000
    assert parse_budget("123456", 0) == 123456
    assert parse_budget(4096, 0) == 4096
    assert parse_budget("50%", 1000) == 500
    assert parse_budget("12.5%", 800) == 100
    assert parse_budget("150%", 800) == 1200  # weights plus room for the KV cache and activations
    assert parse_budget("50%+384MiB", 2000) == 1000 + 384 * MIB  # half the model plus room for the runtime
    assert parse_budget("10% + 1KiB + 24", 1000) == 100 + 1024 + 24
    for bad in ("abc", "0", "0MiB", "0%", "-5MB", "5 parsecs", "", "MiB", "50%+", "+1MiB", "50%+0MiB"):
        with pytest.raises(InvalidArgumentError, match="memory budget"):
            parse_budget(bad, 1000)


def hand_case(budget: int, prefetch: int = 1):
    """embeddings 16 KiB (tied), norm 0, six 8 KiB layers, adapters 4 KiB, KV 4 KiB, activations 8 KiB."""
    parts = PartSizes(embed=16 * KIB, norm=0, lm_head=0, layers=[8 * KIB] * 6)
    needs = MemoryNeeds(context_tokens=10, min_resident_layers=1, adapter_bytes=4 * KIB, prefetch=prefetch)
    return plan_memory(budget, parts, needs, kv_bytes=4 * KIB, activation=8 * KIB)


def test_planner_hand_computed():
    # fixed 32 KiB; keeping r layers costs 32 + 8 r + 8 * min(prefetch + 1, 6 - r) KiB
    plan = hand_case(70_000)
    assert plan.resident_layers == 2 and list(plan.streamed) == [2, 3, 4, 5]
    assert plan.pool_slots == 2 and plan.slot_bytes == 8 * KIB and plan.pool_bytes == 16 * KIB
    assert plan.planned_bytes == 64 * KIB <= 70_000
    assert plan.bytes_per_pass == 32 * KIB  # four streamed layers read per pass
    assert plan.minimum == 56 * KIB  # one resident layer + two buffers
    assert hand_case(56 * KIB).resident_layers == 1
    full = hand_case(80 * KIB)
    assert full.resident_layers == 6 and not full.streamed and full.pool_slots == 0  # all fits: nothing streams
    text = plan.describe()
    assert "streamed layers [2, 6) (4 of 6): 32.0 KiB read per verification pass" in text
    assert "stream buffers (2 x 8.0 KiB)" in text and "resident layers [0, 2)" in text
    assert plan.to_dict()["streamed_layers"] == [2, 3, 4, 5]


def test_draft_vocabulary_rows_are_priced_as_the_head_holds_its_rows():
    # hand_case's parts with a 120-byte head row, 64 rows gathered (+ an 8-byte token id each): 8 KiB more
    parts = PartSizes(embed=16 * KIB, norm=0, lm_head=0, layers=[8 * KIB] * 6, head_row_bytes=120)
    needs = MemoryNeeds(context_tokens=10, min_resident_layers=1, adapter_bytes=4 * KIB, head_rows=64, prefetch=1)
    plan = plan_memory(70_000, parts, needs, kv_bytes=4 * KIB, activation=8 * KIB)
    assert plan.adapter_bytes == 12 * KIB and ("adapters", 12 * KIB) in plan.rows()
    assert plan.resident_layers == 1 and plan.planned_bytes == 64 * KIB  # a layer fewer than hand_case(70_000)


def test_more_prefetch_costs_buffers():
    assert hand_case(70_000, prefetch=0).resident_layers == 3  # one buffer: one more layer fits
    assert hand_case(70_000, prefetch=2).resident_layers == 1


def test_budget_below_minimum_names_it():
    with pytest.raises(BudgetTooSmallError, match=r"below the minimum of 56.0 KiB .*at least 56KiB") as error:
        hand_case(56 * KIB - 1)
    assert "resident layers [0, 1) 8.0 KiB" in str(error.value) and "stream buffers" in str(error.value)


def test_kv_cache_bytes():
    model = tiny_model("llama")  # 4 layers, 2 KV heads of 16 dims, float64
    assert kv_cache_bytes(model.config, 8, tokens=10) == 2 * 2 * 16 * 8 * 10 * 4
    assert kv_cache_bytes(model.config, 8, tokens=10, extra_layers=1) == 2 * 2 * 16 * 8 * 10 * 5


def test_part_sizes_are_the_real_parameter_bytes():
    model = tiny_model("gemma3")  # tied lm_head: counted once
    parts = PartSizes.of(model.hf_model)
    assert parts.lm_head == 0
    assert parts.weights == sum(p.numel() * p.element_size() for p in model.hf_model.parameters())
    untied = PartSizes.of(tiny_model("llama").hf_model)
    assert untied.lm_head == untied.embed == 96 * 64 * 8


def test_memory_needs_per_method(tmp_path):
    model = tiny_model("llama")
    new_adapter(model, "draft", 1, vocab_subset=list(range(10))).save(tmp_path / "draft")
    new_adapter(model, "shallow", 2).save(tmp_path / "shallow")
    config, dtype = model.config, torch.float64
    assert memory_needs(config, dtype, "ar", context_tokens=50).min_resident_layers == 0
    assert memory_needs(config, dtype, "pld").max_tree_tokens == 11
    early = memory_needs(config, dtype, "early-exit", DraftConfig(draft_layer=3, num_draft_tokens=5))
    assert (early.min_resident_layers, early.max_tree_tokens) == (3, 6)
    tree = memory_needs(config, dtype, "tree")
    assert tree.min_resident_layers == 1 and tree.max_tree_tokens == max(b.total_tokens for b in BUCKETS) + 1
    cats = memory_needs(config, dtype, "cats", DraftConfig(adapters=str(tmp_path), total_tokens=8))
    block = sum(p.numel() for p in model.layers[0].parameters()) + 64  # decoder block + its norm
    assert (cats.min_resident_layers, cats.shallow_layers) == (1, 2)  # draft layers resident, shallow ones if room
    assert cats.extra_cache_layers == 2 and cats.max_tree_tokens == 17
    assert cats.adapter_bytes == 2 * block * 8 and cats.head_rows == 10  # the 10 lm_head rows of its vocabulary
    # dytc drafts from lookup and recycling where layers stream, and skips the streamed layers where calibrated
    dytc = memory_needs(config, dtype, "dytc")
    assert dytc.min_resident_layers == 1 and dytc.max_tree_tokens == 16 + 16 + 1  # a lookup chain on a recycling tree
    assert dytc.pass_sizes == (8 + 1, 16 + 1, 16 + 16 + 1)  # left to the budget: a skip chain, the tree, both
    assert dytc.drafter_bytes == memory_needs(config, dtype, "recycle").drafter_bytes == config.vocab_size * 8 * 4
    assert memory_needs(config, dtype, "pld").drafter_bytes == 0  # token recycling's table: int32, 8 per token id
    assert memory_needs(config, dtype, "dytc", DraftConfig(num_draft_tokens=20)).pass_sizes == (21, 33)
    assert dytc.skip_streamed and not memory_needs(config, dtype, "pld").skip_streamed
    skip = memory_needs(config, dtype, "layer-skip", DraftConfig(num_draft_tokens=3))
    assert (skip.min_resident_layers, skip.max_tree_tokens, skip.skip_streamed) == (1, 4, True)
    skip_tree = memory_needs(config, dtype, "layer-skip", DraftConfig(tree_topk=2, total_tokens=12, depth=5))
    assert skip_tree.max_tree_tokens == 13 and skip_tree.draft_tokens == 5  # a read-out of the draft rows per depth
    for shape, message in ((DraftConfig(depth=5), "--depth and --total-tokens shape its trees only"),
                           (DraftConfig(tree_topk=2, num_draft_tokens=5), "length is --depth")):
        with pytest.raises(InvalidArgumentError, match=message):
            memory_needs(config, dtype, "layer-skip", shape)
    # the prompt's states are kept only for adapters, which run on them (the prefill is priced with more copies)
    assert not any(memory_needs(config, dtype, name).prompt_captures
                   for name in ("ar", "pld", "recycle", "layer-skip", "dytc", "tree"))
    assert cats.prompt_captures and memory_needs(config, dtype, "dytc", DraftConfig(adapters=str(tmp_path))).prompt_captures
    # a prompt of unknown length (a server's) runs in chunks where nothing keeps its states; a known one at once
    assert memory_needs(config, dtype, "ar").prompt_chunk == PROMPT_CHUNK
    assert memory_needs(config, dtype, "ar", context_tokens=2048, prompt_tokens=700).prompt_chunk == 0
    assert prompt_forward_tokens(memory_needs(config, dtype, "ar", context_tokens=2048)) == (2048, 512)
    assert prompt_forward_tokens(memory_needs(config, dtype, "ar", context_tokens=300)) == (300, 300)
    assert prompt_forward_tokens(cats) == (cats.context_tokens, cats.context_tokens)  # its adapters keep the states
    assert prompt_text(memory_needs(config, dtype, "ar", context_tokens=2048)) == "2048-token prompt, 512 a forward"


def test_on_gguf_blocks_an_adapter_is_priced_as_its_file_stores_its_matrices(tmp_path):
    """On a model that computes on GGUF blocks an adapter's linears stay as its file stores them (bfloat16 here: 2
    bytes a weight) and only its vectors (norms, biases) take the model's dtype; elsewhere all of it does."""
    model = tiny_model("llama")
    new_adapter(model, "draft", 1).save(tmp_path / "draft", dtype=torch.bfloat16)
    layer = model.layers[0]
    matrices = sum(p.numel() for p in layer.parameters() if p.dim() == 2)
    vectors = sum(p.numel() for p in layer.parameters() if p.dim() == 1) + 64  # + the adapter's final norm
    drafting = DraftConfig(adapters=str(tmp_path), total_tokens=8)
    assert memory_needs(model.config, torch.float32, "tree", drafting, on_blocks=True).adapter_bytes == \
        2 * matrices + 4 * vectors
    assert memory_needs(model.config, torch.float32, "tree", drafting).adapter_bytes == 4 * (matrices + vectors)
    assert HeldAs(4, stored_matrices=True).bytes_of(tmp_path / "draft" / "model.safetensors") == 2 * matrices + 4 * vectors


def test_a_streamed_pass_costs_the_reads_the_pool_cannot_take_ahead_after_the_compute_they_wait_for():
    # 10 streamed layers read in 1.0 s (0.1 s each) into 3 buffers, 8 resident layers, head 0.05 s
    assert streamed_pass_s(8, 10, 3, 1.0, 0.01, 0.05) == pytest.approx(1.0)  # the read: 0.7 + 0.08 + 0.05 < 1.0
    assert streamed_pass_s(8, 10, 3, 1.0, 0.04, 0.05) == pytest.approx(0.7 + 0.32 + 0.05)  # resident compute shows
    assert streamed_pass_s(8, 10, 3, 1.0, 0.12, 0.05) == pytest.approx(18 * 0.12 + 0.05)  # compute-bound
    assert streamed_pass_s(8, 2, 3, 0.2, 0.03, 0.05) == pytest.approx(0.3 + 0.05)  # the pool holds both: compute
    assert streamed_pass_s(8, 0, 3, 0.0, 0.03, 0.05) == pytest.approx(0.24 + 0.05)  # nothing streams


def test_choose_bucket_takes_the_largest_pass_that_costs_at_most_a_tenth_more_than_one_token():
    tree_pass = {1: 1.0, 17: 1.0, 33: 1.1, 65: 1.5}  # read-bound up to 33 tokens, then compute shows
    assert choose_bucket(tree_pass) == BUCKETS[1]
    assert choose_bucket({1: 1.0, 17: 1.3, 33: 1.6, 65: 2.0}) == BUCKETS[0]  # none is nearly free: the smallest
    assert choose_bucket({1: 1.0, 17: 1.0, 33: 1.05, 65: 1.09}) == BUCKETS[2]
    assert choose_bucket({1: 1.0, 17: 1.05, 33: 1.2}, buckets=BUCKETS[:2]) == BUCKETS[0]  # only those planned
    chain_pass = {1: 0.5, 5: 0.5, 7: 0.52, 9: 0.6}
    assert choose_bucket(chain_pass, chain=True).num_draft_tokens == 6
    # the pass times as `speculation_for` makes them: 10 streamed layers read in 1.0 s, 8 resident, 3 buffers
    shape = {n: streamed_pass_s(8, 10, 3, 1.0, 0.002 * n, 0.001 * n) for n in (1, 17, 33, 65)}
    assert shape[17] == pytest.approx(1.0) and shape[33] == pytest.approx(0.7 + 33 * 0.017)  # 1.261: not free
    assert choose_bucket(shape) == BUCKETS[0]


def test_the_budget_caps_the_tree_it_reserves():
    model = tiny_model("llama")
    auto = lambda: memory_needs(model.config, torch.float64, "tree", context_tokens=32, prefetch=2)  # noqa: E731
    roomy = plan_for(model.hf_model, 1 << 40, auto())
    assert roomy.needs.max_tree_tokens == BUCKETS[-1].total_tokens + 1
    smallest = memory_needs(model.config, torch.float64, "tree", DraftConfig(total_tokens=BUCKETS[0].total_tokens), context_tokens=32)
    tight = plan_for(model.hf_model, plan_for(model.hf_model, 1 << 40, smallest).minimum, auto())
    assert tight.needs.max_tree_tokens == BUCKETS[0].total_tokens + 1  # only the smallest bucket's activations fit
    with pytest.raises(BudgetTooSmallError, match=f"activations \\({BUCKETS[0].total_tokens + 1}-token pass or "):
        plan_for(model.hf_model, tight.minimum - 1, auto())


def test_a_larger_tree_is_reserved_only_where_it_keeps_as_many_layers_resident():
    """A budget that would hold a larger bucket's activations only by streaming more layers reserves the smallest
    bucket, keeping those layers resident: a resident layer saves its read on every pass."""
    config = tiny_config("llama")
    config.num_hidden_layers = 10
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    needs = lambda total=None: memory_needs(config, torch.float64, "tree", DraftConfig(total_tokens=total),  # noqa: E731
                                            context_tokens=32, prefetch=1)
    smallest, largest = BUCKETS[0].total_tokens, BUCKETS[-1].total_tokens
    budget = plan_for(hf_model, 1 << 40, needs(smallest)).with_resident(6).planned_bytes
    assert plan_for(hf_model, budget, needs(smallest)).resident_layers == 6
    assert plan_for(hf_model, budget, needs(largest)).resident_layers < 6  # it fits, with fewer layers resident
    plan = plan_for(hf_model, budget, needs())
    assert plan.resident_layers == 6 and plan.needs.max_tree_tokens == smallest + 1
    roomy = plan_for(hf_model, 1 << 40, needs())  # where every layer stays resident, the largest
    assert roomy.resident_layers == 10 and roomy.needs.max_tree_tokens == largest + 1


def test_a_process_budget_plans_for_the_measured_runtime_too():
    """With the runtime's bytes in the needs, every plan needs that much more, and the minimum names it."""
    parts = PartSizes(embed=16 * KIB, norm=0, lm_head=0, layers=[8 * KIB] * 6)
    needs = MemoryNeeds(context_tokens=10, min_resident_layers=1, adapter_bytes=4 * KIB, prefetch=1,
                        runtime_bytes=100 * KIB)
    plan = plan_memory(100 * KIB + 56 * KIB, parts, needs, kv_bytes=4 * KIB, activation=8 * KIB)
    assert plan.planned_bytes == hand_case(56 * KIB).planned_bytes + 100 * KIB
    assert plan.rows()[0] == ("runtime (measured before loading weights)", 100 * KIB)
    with pytest.raises(BudgetTooSmallError, match=r"minimum of 156.0 KiB.*runtime \(measured"):
        plan_memory(155 * KIB, parts, needs, kv_bytes=4 * KIB, activation=8 * KIB)


def test_a_process_budget_keeps_room_for_the_library_pages_every_step_reads():
    """The libraries' hot file pages are planned as their own row, counted in the minimum like the runtime."""
    parts = PartSizes(embed=16 * KIB, norm=0, lm_head=0, layers=[8 * KIB] * 6)
    needs = MemoryNeeds(context_tokens=10, min_resident_layers=1, adapter_bytes=4 * KIB, prefetch=1,
                        runtime_bytes=100 * KIB, library_pages_bytes=20 * KIB)
    plan = plan_memory(176 * KIB, parts, needs, kv_bytes=4 * KIB, activation=8 * KIB)
    assert plan.planned_bytes == hand_case(56 * KIB).planned_bytes + 120 * KIB
    assert plan.rows()[1] == ("library pages read each step", 20 * KIB)
    with pytest.raises(BudgetTooSmallError, match=r"minimum of 176.0 KiB.*library pages read each step"):
        plan_memory(175 * KIB, parts, needs, kv_bytes=4 * KIB, activation=8 * KIB)


def test_a_tight_budget_reads_fewer_layers_ahead_unless_told_how_many():
    """The default read-ahead (2) gives way to 1 where a third stream buffer does not fit; a prefetch the caller
    set is kept, and the budget is then too small."""
    model = tiny_model("llama")
    auto = lambda prefetch=None: memory_needs(model.config, torch.float64, "ar", context_tokens=32,  # noqa: E731
                                              prefetch=prefetch)
    roomy = plan_for(model.hf_model, 1 << 40, auto())
    assert roomy.needs.prefetch == 2 and not roomy.needs.prefetch_fixed
    minimum_two = roomy.minimum
    minimum_one = plan_for(model.hf_model, 1 << 40, auto(1)).minimum
    assert minimum_one < minimum_two
    tight = plan_for(model.hf_model, minimum_one, auto())
    assert tight.needs.prefetch == 1 and tight.pool_slots == 2 and tight.resident_layers == 0
    with pytest.raises(BudgetTooSmallError, match="minimum of"):
        plan_for(model.hf_model, minimum_one, auto(2))
    with pytest.raises(BudgetTooSmallError, match="minimum of"):
        plan_for(model.hf_model, minimum_one - 1, auto())


def test_the_read_ahead_left_to_the_plan_keeps_the_most_layers_resident():
    """Left to the plan, one layer read ahead wins wherever the third stream buffer would take a resident layer's
    room, and two where both keep as many resident; a read-ahead the caller set is kept."""
    model = tiny_model("llama")
    auto = lambda prefetch=None: memory_needs(model.config, torch.float64, "ar", context_tokens=32,  # noqa: E731
                                              prefetch=prefetch)
    full = plan_for(model.hf_model, 1 << 40, auto(2))
    wins = ties = 0
    for budget in [*range(full.minimum, full.planned_bytes, max(1, (full.planned_bytes - full.minimum) // 200)),
                   full.planned_bytes]:
        two, one, chosen = (plan_for(model.hf_model, budget, auto(2)), plan_for(model.hf_model, budget, auto(1)),
                            plan_for(model.hf_model, budget, auto()))
        assert chosen.resident_layers == max(two.resident_layers, one.resident_layers)
        assert chosen.planned_bytes <= budget
        if one.resident_layers > two.resident_layers:
            assert chosen.needs.prefetch == 1 and chosen.pool_slots == 2
            wins += 1
        else:
            assert chosen.needs.prefetch == 2 and chosen.pool_slots == two.pool_slots
            ties += 1
    assert wins and ties  # both cases were met


def test_a_cascade_whose_shallow_layers_stream_reserves_the_bare_tree(tmp_path):
    """The cascade adds corrections only while its shallow layers are resident: a plan that streams one of them
    reserves the bare tree's pass (n + 1 tokens, not 2 n + 1), so it fits a smaller budget; one that keeps them all
    reserves the corrected pass."""
    model = tiny_model("llama")
    new_adapter(model, "draft", 1).save(tmp_path / "draft")
    new_adapter(model, "shallow", 3).save(tmp_path / "shallow")
    needs = lambda: memory_needs(model.config, torch.float64, "cats", DraftConfig(adapters=str(tmp_path)),  # noqa: E731
                                 context_tokens=32, prefetch=1)
    corrected = 2 * BUCKETS[0].total_tokens + 1
    roomy = plan_for(model.hf_model, 1 << 40, needs())
    assert roomy.resident_layers == model.config.num_hidden_layers and roomy.needs.max_tree_tokens >= corrected
    tight, budget = None, roomy.planned_bytes
    while True:  # the smallest budget that runs, in steps of 4 KiB
        try:
            tight, smallest = plan_for(model.hf_model, budget, needs()), budget
        except BudgetTooSmallError:
            break
        budget -= 4096
    assert tight.resident_layers < 3 and tight.needs.max_tree_tokens == BUCKETS[0].total_tokens + 1
    fixed = memory_needs(model.config, torch.float64, "cats", DraftConfig(adapters=str(tmp_path),
                                                                          total_tokens=BUCKETS[0].total_tokens),
                         context_tokens=32, prefetch=1)  # a tree size the caller set keeps its corrected pass
    assert plan_for(model.hf_model, 1 << 40, fixed).minimum > smallest
    with pytest.raises(BudgetTooSmallError):
        plan_for(model.hf_model, smallest, fixed)
