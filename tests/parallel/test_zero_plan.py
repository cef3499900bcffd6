"""The planner half of ZeRO-1/2 (`dtorch/plan/strategies/zero.py`): the plan field, its rules and
limits, the terms the cost model adds, and the search under `--fix zero=N`. One process, no torch.
(The executor half and the collective counts: tests/parallel/test_zero.py.)"""

from __future__ import annotations

import pytest

from dtorch.errors import ConfigError
from dtorch.plan.plan import Plan
from dtorch.plan.strategies import check_executable, normalize_fixed, unsupported

PLAN = dict(dp_shard=8, microbatch_size=1, num_microbatches=8, param_dtype="bfloat16", seq_len=4096,
            global_batch=64)


def _estimate(cluster: str = "h100:1x8", **kw):
    from dtorch.cluster.load import parse_shorthand
    from dtorch.plan.cost import estimate
    from dtorch.plan.profiles import get_profile

    return estimate(Plan(**{**PLAN, **kw}), get_profile("llama3-8b", 4096), parse_shorthand(cluster))


def test_the_field_is_off_by_default_and_left_out_of_old_plan_documents() -> None:
    assert Plan().zero == 0
    assert "zero" not in Plan(dp_shard=2).to_dict()  # every plan file written before it is unchanged
    doc = Plan(dp_shard=2, zero=1).to_dict()
    assert doc["zero"] == 1 and Plan.from_dict(doc).zero == 1
    assert Plan.from_dict({"dp_shard": 2}).zero == 0


def test_fix_parses_stages_and_refuses_zero3() -> None:
    assert normalize_fixed({"zero": "1"}) == {"zero": 1}
    assert normalize_fixed({"zero_stage": 2}) == {"zero": 2}
    assert normalize_fixed({"zero": "off"}) == {"zero": 0}
    with pytest.raises(ConfigError, match="ZeRO-3 is FSDP"):
        normalize_fixed({"zero": 3})


def test_rules_and_limits_name_the_field() -> None:
    # without a dp_shard x cp axis there is nothing to shard: zero changes nothing (Megatron at dp=1)
    assert Plan(tp=2, zero=1).validate().family() == "TP" and unsupported(Plan(tp=2, zero=1)) is None
    with pytest.raises(ConfigError, match="zero"):
        Plan(dp_shard=2, zero=4).validate()
    assert unsupported(Plan(dp_shard=2, tp=2, pp=2, zero=2)) is None  # TP and PP compose
    assert unsupported(Plan(dp_shard=2, cp=2, zero=1)) is None
    assert unsupported(Plan(dp_shard=4, ep=2, zero=2)) is None  # EP too (ZeRO-2 x EP x PP is a limit)
    for kw, field in ((dict(dp_replicate=2), "dp_replicate"), (dict(dp_replicate=2, dp_shard=1), "dp_replicate"),
                      (dict(zero=2, ep=2, pp=2), "zero"), (dict(offload="params"), "offload"),
                      (dict(zero=2, pp=2, schedule="zero_bubble", reshard_after_forward=False), "zero"),
                      (dict(zero=2, dp_shares=[3, 1], num_microbatches=2, reshard_after_forward=False), "zero")):
        plan = Plan(**{"dp_shard": 2, "zero": 1, **kw})
        with pytest.raises(ConfigError) as err:
            check_executable(plan)
        assert err.value.field == field
    assert Plan(dp_shard=2, zero=1).family() == "ZeRO1"
    assert Plan(dp_shard=2, tp=2, zero=2).family() == "ZeRO2xTP"
    assert "zero2" in Plan(dp_shard=2, zero=2).describe()


def test_zero1_traffic_is_once_per_step_and_zero2_grows_with_microbatches() -> None:
    from dtorch.plan.strategies.zero import ZERO

    assert ZERO.collectives(Plan(dp_shard=2, zero=1, num_microbatches=8)) == (1, 1)
    assert ZERO.collectives(Plan(dp_shard=2, zero=2, num_microbatches=8)) == (1, 8)
    # the per-step data-parallel seconds on CPUs (where no compute hides them): ZeRO-1 the same for 2
    # and 8 micro-batches, ZeRO-2 more for 8
    z1, z2 = ([_estimate("cpu:1x8", zero=z, num_microbatches=m, global_batch=8 * m, param_dtype="float32")
               .time_breakdown["fsdp"] for m in (2, 8)] for z in (1, 2))
    assert z1[0] == pytest.approx(z1[1])
    assert z2[1] > z2[0]
    fsdp = _estimate(reshard_after_forward=True).time_breakdown["fsdp"]
    assert _estimate(zero=1).time_breakdown["fsdp"] < fsdp  # one gather and one reduction per step, not per micro-batch


def test_memory_terms_params_replicated_optimizer_sharded_grads_by_stage() -> None:
    from dtorch.plan.step import DTYPE_BYTES

    p = 8.03e9  # llama3-8b's parameters, roughly
    fsdp, z1, z2 = (_estimate(**kw).memory_breakdown for kw in (dict(reshard_after_forward=True), dict(zero=1),
                                                                 dict(zero=2)))
    assert z1["optimizer"] == z2["optimizer"] == fsdp["optimizer"]  # AdamW's moments sharded over dp_shard
    assert z1["optimizer"] == pytest.approx(8 * p / 8, rel=0.02)
    # parameters: the float32 shard plus the whole model gathered in bfloat16
    assert z1["params"] == pytest.approx(4 * p / 8 + DTYPE_BYTES["bfloat16"] * p, rel=0.02)
    assert z1["params"] > fsdp["params"]
    # ZeRO-1: full-size gradients accumulated in float32 (reduce_dtype); ZeRO-2: the shard only
    assert z1["grads"] == pytest.approx(4 * p, rel=0.02)
    assert z2["grads"] == pytest.approx(4 * p / 8, rel=0.02)


def test_search_ranks_zero_plans_only_where_the_executor_runs_them() -> None:
    from dtorch.cluster.load import parse_shorthand
    from dtorch.plan.profiles import get_profile
    from dtorch.plan.search import search

    res = search(get_profile("llama3-8b", 4096), parse_shorthand("h100:1x8"), global_batch=64,
                 fixed={"zero": 1, "pp": 1, "cp": 1}, top_k=3)
    assert res.ranked and all(p.zero == 1 and p.dp_shard > 1 and p.dp_replicate == 1 and not unsupported(p)
                              for p, _ in res.ranked)
    assert all(p.family().startswith("ZeRO1") for p, _ in res.ranked)
    # replicas with ZeRO are never ranked, and the search says why
    assert any("ZeRO over dp_replicate" in why for why in res.rejected.values())
    forced = search(get_profile("llama3-8b", 4096), parse_shorthand("h100:1x8"), global_batch=64,
                    fixed={"zero": 1, "dp_replicate": 2, "dp_shard": 4, "tp": 1, "pp": 1, "cp": 1}, top_k=3)
    assert any("ZeRO over dp_replicate" in n for n in forced.notes)  # evaluated as asked, flagged as not runnable
