"""The planner's side of context parallelism: CP with PP offered where the executor runs it, and
the all-gather or the ring chosen by their prices (pure functions: milliseconds)."""

from __future__ import annotations

import dataclasses

import pytest

from dtorch.plan import strategies
from dtorch.plan.plan import Plan
from dtorch.plan.strategies.context import CONTEXT, KvExchange, ring_exposed


def test_cp_with_pp_is_offered_and_zero_bubble_keeps_the_stage_gathered() -> None:
    assert strategies.unsupported(Plan(cp=2, pp=2, num_microbatches=2)) is None
    assert strategies.unsupported(Plan(cp=2, pp=2, num_microbatches=2, cp_attention="ring")) is None
    # cp > 1 shards over cp with FSDP: zero-bubble's split backward loses weight gradients resharded
    why = strategies.unsupported(Plan(cp=2, pp=2, num_microbatches=2, schedule="zero_bubble"))
    assert why and "resharding" in why
    assert strategies.unsupported(Plan(cp=2, pp=2, num_microbatches=2, schedule="zero_bubble",
                                       reshard_after_forward=False)) is None


def test_the_other_attention_is_a_variant_unless_fixed() -> None:
    plan = Plan(cp=2)
    (other,) = CONTEXT.variants(plan, {}, None)
    assert other.cp_attention == "ring" and dataclasses.replace(other, cp_attention="allgather") == plan
    assert CONTEXT.variants(plan, {"cp_attention": "allgather"}, None) == []
    assert CONTEXT.variants(Plan(), {}, None) == []
    assert CONTEXT.variants(Plan(cp=2, compile=True), {}, None) == []  # ring under compile: a limit


def test_ring_hides_each_step_behind_the_attention_of_the_block_held() -> None:
    t = KvExchange(kv_s=1.0, ring_kv_s=0.1, ring_dkv_s=0.2, attn_fwd_s=4.0, attn_bwd_s=8.0, overlap=True)
    fwd, bwd = ring_exposed(4, t)
    assert fwd == 0.0 and bwd == pytest.approx(0.2)  # only the last accumulator's hop home shows
    slow = dataclasses.replace(t, attn_fwd_s=0.2, attn_bwd_s=0.4)  # short attention: transfers show
    fwd, bwd = ring_exposed(4, slow)
    assert fwd == pytest.approx(3 * (0.1 - 0.05)) and bwd == pytest.approx(3 * (0.3 - 0.1) + 0.2)
    shared = dataclasses.replace(t, overlap=False)  # an oversubscribed CPU: nothing hides
    assert ring_exposed(4, shared) == pytest.approx((0.3, 3 * 0.3 + 0.2))


@pytest.mark.parametrize("seq_len,winner", [(32768, "ring"), (512, "allgather")])
def test_search_ranks_the_cheaper_attention_first(seq_len: int, winner: str) -> None:
    """Long sequences give each ring step enough attention to hide its transfer; short ones leave
    the ring's extra backward traffic (float32 accumulators) exposed. The search prices both."""
    from dtorch.cluster.load import parse_shorthand
    from dtorch.plan.profiles import get_profile
    from dtorch.plan.search import parse_fix, search

    result = search(get_profile("llama3-8b", seq_len), parse_shorthand("h100:2x8"), global_batch=16,
                    fixed=parse_fix("cp=2,pp=2"))
    ranked = [plan for plan, _ in result.ranked]
    assert ranked[0].cp_attention == winner
    assert {p.cp_attention for p in ranked} == {"allgather", "ring"}
    # the same plan with the other attention is ranked, and priced differently in its CP term only
    (twin, est), = [(p, e) for p, e in result.ranked
                    if p == dataclasses.replace(ranked[0], cp_attention=p.cp_attention) and p != ranked[0]]
    first = result.ranked[0][1]
    assert est.time_breakdown["cp"] > first.time_breakdown["cp"]
    assert est.time_breakdown["compute"] == first.time_breakdown["compute"]
