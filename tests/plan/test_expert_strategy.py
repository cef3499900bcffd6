"""The expert-parallel strategy (`dtorch/plan/strategies/expert.py`): its rules, its limits (the
executor wiring's), `--fix ep`, its all-to-all term per link class, expert memory, the MoE size
accounting the estimate uses, and the search's EP plans. Torch-free, about 3 s."""

from __future__ import annotations

import dataclasses

import pytest

from dtorch.cluster.load import parse_shorthand
from dtorch.errors import ConfigError
from dtorch.plan.cost import DEFAULT_CONSTANTS, _rank_params, estimate, model_buffer_bytes, model_state_bytes
from dtorch.plan.plan import Plan
from dtorch.plan.profiles import get_profile
from dtorch.plan.search import _bound, _Mesh, check, parse_fix, precisions, search
from dtorch.plan.strategies import check_executable, unsupported
from dtorch.plan.strategies.base import RankLoad
from dtorch.plan.strategies.expert import EXPERT, all_to_all_time


def test_ep_must_divide_the_data_parallel_ranks_and_the_experts():
    with pytest.raises(ConfigError) as e:
        Plan(dp_shard=4, ep=3).validate()
    assert e.value.field == "ep" and "{1, 2, 4}" in str(e.value)
    cl = parse_shorthand("cpu:1x4")
    moe = get_profile("moe-tiny", 16)  # 8 experts
    check(Plan(dp_shard=4, ep=4), moe, cl)
    with pytest.raises(ConfigError, match="must divide the 6 routed experts"):
        check(Plan(dp_shard=4, ep=4), dataclasses.replace(moe, num_experts=6), cl)
    with pytest.raises(ConfigError, match="dense") as e:
        check(Plan(dp_shard=4, ep=2), get_profile("llama-tiny", 16), cl)
    assert e.value.field == "ep"


def test_limits_mirror_the_executor_wiring():
    assert unsupported(Plan(dp_shard=4, ep=2)) is None
    assert unsupported(Plan(dp_shard=4, ep=2, ac="full")) is None
    assert unsupported(Plan(dp_shard=2, tp=2, ep=2)) is None  # EP x TP (expert-tensor parallelism)
    assert unsupported(Plan(pp=2, dp_shard=2, ep=2)) is None  # EP x PP
    assert unsupported(Plan(dp_shard=2, cp=2, ep=2)) is None  # EP x CP (the ep ranks from dp_shard x cp)
    # replicas (DDP, HSDP): ep ranks inside one replica's shard group, or over whole replicas
    for plan in (Plan(dp_replicate=4, ep=2), Plan(dp_replicate=4, ep=4), Plan(dp_replicate=2, dp_shard=2, ep=2),
                 Plan(dp_replicate=2, dp_shard=2, ep=4), Plan(dp_replicate=2, dp_shard=4, ep=8)):
        assert unsupported(plan) is None, plan
    for plan in (Plan(dp_replicate=2, cp=3, ep=2),  # 2 of a replica's 3 (dp_shard x cp) ranks
                 Plan(dp_replicate=2, dp_shard=3, ep=2),  # 2 of a replica's 3 shard ranks
                 Plan(dp_replicate=3, dp_shard=2, ep=4),  # 2 of the 3 replicas
                 Plan(dp_shard=4, ep=2, ac="selective"),
                 Plan(dp_shard=4, ep=2, offload="params")):
        with pytest.raises(ConfigError) as e:
            check_executable(plan)
        assert e.value.field == "ep"
    with pytest.raises(ConfigError) as e:  # MoE blocks do not route sequence shards
        check_executable(Plan(dp_shard=2, tp=2, ep=2, sp=True))
    assert e.value.field == "sp"


def test_fix_ep():
    assert parse_fix("ep=8") == {"ep": 8}
    cl = parse_shorthand("h100:1x8")
    with pytest.raises(ConfigError, match="dense") as e:
        search(get_profile("llama3-8b", 1024), cl, global_batch=64, fixed={"ep": 2})
    assert e.value.field == "ep"
    with pytest.raises(ConfigError) as e:
        search(get_profile("mixtral-8x7b", 1024), cl, global_batch=64, fixed={"ep": 3})
    assert e.value.field == "ep"
    res = search(get_profile("mixtral-8x7b", 1024), parse_shorthand("h100:4x8"), global_batch=256,
                 fixed={"ep": 8})
    assert res.ranked and all(p.ep == 8 for p, _ in res.ranked)


def test_all_to_all_inter_node_is_the_expensive_case():
    g = parse_shorthand("h100:4x8").groups[0]
    nbytes = 1e9
    intra = all_to_all_time(nbytes, 8, 1, g)  # one node, NVLink
    inter = all_to_all_time(nbytes, 16, 1, g)  # two nodes: half of it through the NICs
    assert all_to_all_time(nbytes, 1, 1, g) == 0.0
    assert inter > 3 * intra
    # alpha-beta: the off-node share (ep - k)/ep at the NIC's bandwidth
    expect = nbytes * 7 / 16 / (g.intra.bandwidth * g.intra.efficiency) + 7 * g.intra.latency \
        + nbytes * 8 / 16 / (g.inter.bandwidth * g.inter.efficiency) + g.inter.latency
    assert inter == pytest.approx(expect)


def test_ep_term_in_the_estimate_and_load_imbalance():
    prof, cl = get_profile("mixtral-8x7b", 4096), parse_shorthand("h100:4x8")
    base = dict(dp_shard=32, microbatch_size=1, num_microbatches=2, ac="full", param_dtype="bfloat16")
    e1 = estimate(Plan(**base), prof, cl)
    e8 = estimate(Plan(**base, ep=8), prof, cl)
    assert e1.time_breakdown["ep"] == 0.0 and e8.time_breakdown["ep"] > 0.0
    # tokens x top_k x hidden x 2 bytes, 6 all-to-alls per MoE block per micro-batch under full AC
    per = 4096 * 2 * 4096 * 2.0
    a2a = all_to_all_time(per, 8, 1, cl.groups[0])
    counts = all_to_all_time(8.0 * 8, 8, 1, cl.groups[0])  # the per-expert count exchange, again in recompute
    assert e8.time_breakdown["ep"] == pytest.approx(2 * 32 * (6 * a2a + 2 * counts), rel=1e-9)
    # EP shrinks FSDP's traffic (experts gathered over edp only) and its gathered block
    assert e8.time_breakdown["fsdp"] < e1.time_breakdown["fsdp"]
    assert e8.memory_breakdown["params"] < e1.memory_breakdown["params"]  # (the gathered copies are parameters)
    # model states are sharded over all 32 ranks either way
    assert e8.memory_breakdown["optimizer"] == e1.memory_breakdown["optimizer"]
    old = EXPERT.load_imbalance
    try:
        EXPERT.load_imbalance = 1.5
        e8b = estimate(Plan(**base, ep=8), prof, cl)
    finally:
        EXPERT.load_imbalance = old
    assert e8b.time_breakdown["ep"] > 1.4 * e8.time_breakdown["ep"]


def test_a_pipelined_or_unresharded_ep_rank_holds_only_its_own_experts_gathered():
    """Without resharding a rank keeps its stage gathered, and pipelining accumulates unsharded
    gradients until the last micro-batch: of the routed experts, only the rank's own 1/ep."""
    prof, cl = get_profile("mixtral-8x7b", 4096), parse_shorthand("h100:4x8")
    base = dict(pp=2, dp_shard=16, microbatch_size=1, num_microbatches=4, ac="full", param_dtype="bfloat16",
                reshard_after_forward=False)
    e1, e8 = estimate(Plan(**base), prof, cl), estimate(Plan(**base, ep=8), prof, cl)
    pe = 16 * prof.num_experts * prof.params_per_expert  # a stage's routed experts (16 of 32 blocks)
    saved = 2 * pe * (1 - 1 / 8)  # bf16 bytes of the other ep ranks' experts
    # (the accumulated gradients are in reduce_dtype, float32: FSDP2's `to_accumulated_grad_if_needed`)
    assert e1.memory_breakdown["grads"] - e8.memory_breakdown["grads"] == pytest.approx(2 * saved, rel=1e-6)
    # (gathered copies are params; the fullest ranks may be different stages: the final norm's weight)
    assert e1.memory_breakdown["params"] - e8.memory_breakdown["params"] == pytest.approx(saved, rel=1e-6)
    # sharded over all 16 either way
    assert e8.memory_breakdown["optimizer"] == pytest.approx(e1.memory_breakdown["optimizer"], rel=1e-6)


def test_routed_experts_run_at_the_speed_of_their_own_gemms():
    """The executor computes one GEMM chain per local expert: rows = tokens x top_k x ep / experts,
    under the shape factor (fewer rows per expert at small ep: slower); a system with a measured expert
    kernel (torchtitan's torch._grouped_mm on a B200) at that kernel's efficiency."""
    from dtorch.cluster.shape import shape_factor
    from dtorch.plan.cost import base_efficiency
    from dtorch.plan.strategies.expert import TORCH_GROUPED_MM_BF16, TORCHTITAN_ETP1_DISPATCH

    prof, cl = get_profile("deepseek-v3", 4096), parse_shorthand("h100:4x8")
    g, c = cl.groups[0], DEFAULT_CONSTANTS
    est = {ep: estimate(Plan(dp_shard=32, ep=ep, ac="none", param_dtype="bfloat16"), prof, cl) for ep in (8, 32)}
    speed = {ep: g.device.peak("bfloat16") * base_efficiency(g, c)
             * shape_factor(prof.hidden, 4096 * 8 * ep / 256, c.gemm_width_half, c.gemm_rows_half) for ep in (8, 32)}
    routed = 4096 * prof.num_layers * (1 - 3 / 61) * 6 * 8 * prof.params_per_expert  # 58 MoE blocks of 61
    assert est[8].time_breakdown["compute"] - est[32].time_breakdown["compute"] == pytest.approx(
        routed * (1 / speed[8] - 1 / speed[32]), rel=1e-6)
    # torchtitan with ETP=1 (a what-if): 1/tp of the tokens each, ep ranks consecutive, grouped_mm's speed
    b200, plan = parse_shorthand("b200:4x8"), Plan(tp=2, sp=True, dp_shard=16, ep=16, ac="none", param_dtype="bfloat16")
    with EXPERT.what_if(TORCHTITAN_ETP1_DISPATCH):
        tt = estimate(plan, prof, b200)
    assert EXPERT.dispatcher.ep_borrows_tp is False  # restored
    nbytes = 4096 / 2 * 8 * prof.hidden * 2.0
    pairs = 2 * (all_to_all_time(nbytes, 16, 1, b200.groups[0]) * 2) + all_to_all_time(8.0 * 256, 16, 1, b200.groups[0])
    assert tt.time_breakdown["ep"] == pytest.approx(58 * pairs, rel=1e-6)
    assert dict(TORCH_GROUPED_MM_BF16)["B200-180GB"] == pytest.approx(0.335, abs=0.001)


def test_ep_with_replicas_prices_the_rank_s_own_experts_over_the_executor_s_groups():
    """DDP/HSDP x EP as `dtorch.parallel.expert` runs it: model states hold 1/ep of the routed experts
    (and 1/dp_shard of them inside a replica), no DDP buckets; the gradient all-reduce moves the
    non-expert shard over all replicas and the rank's own experts over the replicas its ep group does
    not span, at their stride (inter-node here), every micro-batch without PP. Hand-computed on
    moe-tiny (2 MoE blocks of 8 experts of 6,144 parameters, 70,976 other parameters)."""
    from dtorch.plan.cost import step_shape
    from dtorch.plan.strategies.data import DATA
    from dtorch.plan.strategies.expert import expert_groups
    from dtorch.plan.strategies.pipeline import rank_loads

    prof, cpu = get_profile("moe-tiny", 16), parse_shorthand("cpu:1x4")
    E, N = 2 * 8 * 6144, 2 * 68224 + 16384 + 16448 - 2 * 8 * 6144
    f32 = dict(param_dtype="float32", reduce_dtype="float32", microbatch_size=2)
    for kw, held in ((dict(dp_replicate=4, ep=2), N + E / 2),  # DDP x EP: ep over 2 replicas
                     (dict(dp_replicate=4, ep=4), N + E / 4),
                     (dict(dp_replicate=2, dp_shard=2, ep=2), N / 2 + E / 2),  # ep inside a replica
                     (dict(dp_replicate=2, dp_shard=2, ep=4), N / 2 + E / 4)):  # ep over both replicas
        states = model_state_bytes(Plan(**kw, **f32), prof)
        assert (states["params"], states["grads"], states["optimizer"]) == (4 * held, 4 * held, 8 * held), kw
        assert estimate(Plan(**kw, **f32), prof, cpu).memory_breakdown["optimizer"] == 8 * held, kw
    # (measured on 4 gloo ranks after one AdamW step, dp_replicate=4 ep=2: 480,512 / 480,512 / 961,024 bytes)
    ddp_ep = estimate(Plan(dp_replicate=4, ep=2, **f32), prof, cpu).memory_breakdown
    # at the peak: the float32 masters and the stage gathered beside them (FSDP2 replica units never
    # reshard); no DDP buckets, the model's RoPE tables as buffers
    assert ddp_ep["params"] == 4 * (N + E / 2) + 4 * (N + E / 2)
    assert ddp_ep["buffers"] == model_buffer_bytes(prof)
    # mesh (edp_rep, edp_shard, ep_rep, ep_shard): (shard size, stride, replica size, stride)
    assert expert_groups(Plan(dp_replicate=2, dp_shard=4, ep=2)) == (2, 2, 2, 4)
    assert expert_groups(Plan(dp_replicate=4, dp_shard=2, ep=4)) == (1, 4, 2, 4)
    assert expert_groups(Plan(dp_replicate=8, ep=4, tp=2)) == (1, 8, 2, 8)
    assert expert_groups(Plan(dp_shard=8, ep=2)) == (4, 2, 1, 8)
    # the all-reduce of DDP x EP over 8 H100s on 2 nodes: non-expert over 4 x 2 nodes, experts over 2 nodes
    h100 = parse_shorthand("h100:2x4")
    g = h100.groups[0]
    bi, be = g.intra.bandwidth * g.intra.efficiency, g.inter.bandwidth * g.inter.efficiency
    plan = Plan(dp_replicate=8, ep=4, microbatch_size=1, param_dtype="bfloat16", reduce_dtype="bfloat16")
    step = step_shape(plan, prof, h100)
    load = rank_loads(plan, prof.num_layers, prof.num_dense_layers)[0]
    b, bx = 2.0 * N, 2.0 * E / 4
    want = (2 * (b * 3 / 4 / bi + 3 * g.intra.latency) + 2 * (b / 4 / 2 / be + g.inter.latency)
            + 2 * (bx / 2 / be + g.inter.latency))
    assert DATA.grad_comm(step, load, step.p_stage(load), latency=False) == pytest.approx(want, rel=1e-12)
    # FSDP2 units sync every micro-batch (on a CPU nothing hides them); classic DDP once per step
    dp = {(ep, m): estimate(Plan(dp_replicate=4, ep=ep, microbatch_size=2 // m, num_microbatches=m), prof,
                            cpu).time_breakdown["dp"] for ep in (1, 2) for m in (1, 2)}
    assert dp[2, 2] == pytest.approx(2 * dp[2, 1], rel=1e-9) and dp[1, 2] == pytest.approx(dp[1, 1], rel=1e-9)


def test_moe_sizes_count_dense_first_blocks_at_their_own_size():
    prof = get_profile("deepseek-v3", 4096)
    whole = RankLoad(0, prof.num_layers, 1.0, 1.0, prof.num_dense_layers)
    assert _rank_params(whole, prof, 1) == pytest.approx(prof.params_total, rel=1e-6)
    # per pipeline rank: the dense blocks where they are (pp=32: ranks 0 and 1), MoE blocks elsewhere
    from dtorch.plan.strategies.pipeline import rank_loads

    loads = rank_loads(Plan(pp=32, dp_shard=8, num_microbatches=32), prof.num_layers, prof.num_dense_layers)
    assert sum(ld.dense_blocks for ld in loads) == 3 and [ld.dense_blocks for ld in loads[:3]] == [2, 1, 0]
    assert sum(_rank_params(ld, prof, 1) for ld in loads) == pytest.approx(prof.params_total, rel=1e-6)
    assert _rank_params(loads[2], prof, 1) == pytest.approx(2 * prof.params_per_block, rel=1e-9)


def test_the_bound_stays_below_ep_plans():
    prof, cl = get_profile("mixtral-8x7b", 4096), parse_shorthand("h100:4x8")
    group = cl.slowest_group()
    precs, _ = precisions(group, {})
    for ep in (1, 2, 8, 32):
        for mbs, nmb in ((1, 8), (2, 4)):
            plan = Plan(dp_shard=32, ep=ep, microbatch_size=mbs, num_microbatches=nmb, param_dtype="bfloat16")
            est = estimate(plan, prof, cl)
            for b in (0, mbs):
                assert _bound(_Mesh(1, 1, 32, 1, 1), b, prof, group, 256, precs, DEFAULT_CONSTANTS) <= est.step_time_s
    # with replicas (DDP, HSDP) a larger ep shrinks the gradient all-reduce too
    for r, sh, ep in ((32, 1, 1), (32, 1, 2), (32, 1, 8), (4, 8, 2), (4, 8, 8), (8, 4, 8)):
        plan = Plan(dp_replicate=r, dp_shard=sh, ep=ep, microbatch_size=1, num_microbatches=8, param_dtype="bfloat16")
        est = estimate(plan, prof, cl)
        for b in (0, 1):
            assert _bound(_Mesh(1, r, sh, 1, 1), b, prof, group, 256, precs, DEFAULT_CONSTANTS) <= est.step_time_s


def test_deepseek_v3_on_256_h100s_gets_a_fitting_expert_parallel_plan():
    res = search(get_profile("deepseek-v3", 4096), parse_shorthand("h100:32x8"), global_batch=2048, seq_len=4096)
    assert res.ranked
    plan, est = res.best
    assert est.fits and plan.ep > 1 and unsupported(plan) is None
    assert not any(p.sp for p, _ in res.ranked)  # TP of a MoE runs without sequence parallelism


def test_zero_bubble_under_fsdp_must_keep_the_stage_gathered_and_is_offered_for_a_moe():
    """Zero-bubble's split backward finds no weight of a resharded FSDP stage (torch 2.13, every
    stage but the first ends without gradients): parallelize refuses reshard_after_forward with it
    before any process group, dense or MoE, and the search offers zero-bubble for the MoE only
    without resharding (tests/parallel/test_moe_planner_plans.py runs it against one process)."""
    from functools import partial

    from dtorch.models import build_model
    from dtorch.parallel import parallelize
    from dtorch.train.losses import next_token

    plan = Plan(pp=2, dp_shard=2, microbatch_size=1, num_microbatches=2, schedule="zero_bubble")
    for name in ("moe-tiny", "llama-tiny"):
        with pytest.raises(ConfigError) as e:
            parallelize(partial(build_model, name), plan, loss_fn=next_token, seq_len=16)
        assert e.value.field == "reshard_after_forward" and "reshard_after_forward=false" in str(e.value)
    assert unsupported(Plan(pp=2, dp_shard=2, microbatch_size=1, num_microbatches=2, schedule="zero_bubble",
                            reshard_after_forward=False)) is None
    res = search(get_profile("moe-tiny", 16), parse_shorthand("cpu:1x4"), global_batch=8, seq_len=16,
                 fixed={"schedule": "zero_bubble", "ep": 2})
    plans = [p for p, _ in [*res.ranked, *res.best_by_family.values()]]
    assert plans and all(p.schedule == "zero_bubble" and p.ep == 2 and not p.reshard_after_forward for p in plans)
