"""The cost model's formulas against hand-computed cases, and its properties."""

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtorch.cluster import load_cluster, local_cluster
from dtorch.cluster.shape import attention_efficiency
from dtorch.errors import ConfigError
from dtorch.plan.cost import (
    DEFAULT_CONSTANTS,
    axis_layout,
    collective_time,
    estimate,
    model_state_bytes,
    rank_loads,
    shape_factor,
    step_counts,
    with_constants,
)
from dtorch.plan.plan import Plan
from dtorch.plan.profiles import analytic_profile

GB = 1e9


def llama(layers=8, hidden=1024, heads=16, kv=4, ffn=4096, seq=2048, vocab=32000):
    return analytic_profile("t", "llama", layers=layers, hidden=hidden, heads=heads, kv_heads=kv, ffn=ffn,
                            vocab=vocab, seq_len=seq)


H100 = load_cluster("h100:2x8").groups[0]


def test_axis_layout_places_tp_inside_a_node_and_outer_axes_across():
    assert axis_layout(1, 8, 8) == (8, 1)  # tp=8: one node
    assert axis_layout(8, 4, 8) == (1, 4)  # next axis at stride 8: one rank per node
    assert axis_layout(2, 8, 8) == (4, 2)  # stride 2, size 8: 4 ranks per node over 2 nodes


def test_all_gather_inside_a_node_is_ring_alpha_beta():
    bw = 450e9 * 0.8
    expect = 1 * GB * 7 / 8 / bw + 7 * 2e-6
    assert collective_time("all_gather", 1 * GB, 8, 1, H100) == pytest.approx(expect)


def test_all_reduce_across_nodes_is_hierarchical():
    bi, be = 450e9 * 0.8, 50e9 * 0.85
    S = 4 * GB
    intra = 2 * (S * 7 / 8 / bi + 7 * 2e-6)
    inter = 2 * ((S / 8) * (1 / 2) / be + 1 * 5e-6)  # 2 nodes, each GPU's NIC carries 1/8 of S
    assert collective_time("all_reduce", S, 16, 1, H100) == pytest.approx(intra + inter)
    # the same array over ranks one per node uses only the NICs
    flat = 2 * (S * 1 / 2 / be + 5e-6)
    assert collective_time("all_reduce", S, 2, 8, H100) == pytest.approx(flat)


def test_compute_time_is_flops_over_peak_times_efficiency():
    prof = llama()
    cl = load_cluster("h100:1")
    c = with_constants(elementwise_passes=0.0)
    plan = Plan(param_dtype="bfloat16", microbatch_size=2, num_microbatches=3)
    est = estimate(plan, prof, cl, constants=c)
    eff = cl.groups[0].device.matmul_efficiency * shape_factor(prof.hidden, 2 * prof.seq_len, c)
    tokens = 2 * 3 * prof.seq_len
    flops = tokens * prof.flops_per_token  # tokens per step x FLOPs per token
    # the attention core at the published H100 speed of SDPA's kernel (cuDNN), the rest at the GEMMs'
    attn = tokens * prof.num_layers * 12.0 * prof.hidden * prof.seq_len
    attn_speed = 989e12 * attention_efficiency("H100-SXM-80GB", "cudnn", prof.hidden / prof.num_heads, prof.seq_len)
    assert est.time_breakdown["compute"] == pytest.approx((flops - attn) / (989e12 * eff) + attn / attn_speed)
    assert est.efficiency == pytest.approx(eff)
    # MFU counts model FLOPs (no recompute) over the bf16 peak
    assert est.mfu == pytest.approx(est.tokens_per_s * prof.flops_per_token / 989e12)


def test_full_recompute_adds_a_third_of_block_compute():
    prof = llama()
    cl = load_cluster("h100:1")
    c = with_constants(elementwise_passes=0.0)
    base = estimate(Plan(), prof, cl, constants=c)
    full = estimate(Plan(ac="full"), prof, cl, constants=c)
    blocks = prof.num_layers * prof.flops_per_token_block / prof.flops_per_token
    assert full.time_breakdown["recompute"] == pytest.approx(base.time_breakdown["compute"] * blocks / 3)


def test_model_state_memory_follows_zero_formulas():
    prof = llama()
    psi = prof.params_total
    ddp = model_state_bytes(Plan(dp_replicate=8), prof)
    fsdp = model_state_bytes(Plan(dp_shard=8), prof)
    off = model_state_bytes(Plan(dp_shard=8, offload="optimizer"), prof)
    assert sum(ddp.values()) == pytest.approx(16 * psi, rel=1e-6)  # 4 + 4 + 8 bytes/param
    assert sum(fsdp.values()) == pytest.approx(16 * psi / 8, rel=1e-6)  # ZeRO-3: 16 psi / N
    assert off["optimizer"] == 0 and sum(off.values()) == pytest.approx(8 * psi / 8, rel=1e-6)
    assert sum(model_state_bytes(Plan(dp_shard=8, offload="params"), prof).values()) == 0


def test_pipeline_bubble_matches_the_1f1b_share_and_interleaving_divides_it():
    prof = llama(layers=8)
    cl = load_cluster("h100:4")
    c = with_constants(pp_p2p_exposed=0.0)
    p, m = 4, 8
    one = estimate(Plan(pp=4, num_microbatches=m, schedule="1f1b"), prof, cl, constants=c)
    busy = sum(one.time_breakdown[k] for k in ("compute", "recompute", "tp", "cp"))
    share = one.time_breakdown["bubble"] / (busy + one.time_breakdown["bubble"])
    assert share == pytest.approx((p - 1) / (m + p - 1))
    inter = estimate(Plan(pp=4, num_microbatches=m, schedule="interleaved_1f1b", virtual_stages=2), prof, cl,
                     constants=c)
    assert inter.time_breakdown["bubble"] == pytest.approx(one.time_breakdown["bubble"] / 2)
    gpipe = estimate(Plan(pp=4, num_microbatches=m, schedule="gpipe"), prof, cl, constants=c)
    assert gpipe.time_breakdown["bubble"] == pytest.approx(one.time_breakdown["bubble"])


def test_gpipe_keeps_all_microbatches_in_flight_1f1b_only_p():
    prof = llama(layers=8, vocab=256)  # a small head: the first stage holds the most
    cl = load_cluster("h100:4")
    p, m = 4, 16
    p1, pg = (Plan(param_dtype="bfloat16", pp=p, num_microbatches=m, schedule=s) for s in ("1f1b", "gpipe"))
    one, gp = estimate(p1, prof, cl), estimate(pg, prof, cl)
    first, last = rank_loads(p1, prof.num_layers)[0], rank_loads(pg, prof.num_layers)[-1]
    # 1F1B's first stage: p micro-batches, no head but the embedding's output (the first block's
    # input: float32 under autocast, the residual stream's dtype), and the backward's working set
    # of one block
    per_mb = (one.memory_breakdown["activations"] - _working_set(p1, prof, cl, first)) / p
    per_mb -= 4 * prof.hidden * prof.seq_len
    # GPipe: every stage holds all m; the last one also the head's of each (its final norm's input
    # float32, 2 h more than the profile's 16-bit figure; the logits, bf16, which the stage keeps as
    # its output for its backward, are the tensor the loss keeps)
    head = (prof.act_bytes_per_token_head + 2 * prof.hidden) * prof.seq_len
    assert gp.memory_breakdown["activations"] == pytest.approx(
        (per_mb + head) * m + _working_set(pg, prof, cl, last), rel=1e-6)


def _working_set(plan, prof, cl, load):
    """The backward's working set the estimate adds to rank `load`'s saved activations."""
    from dtorch.plan.cost import step_shape
    from dtorch.plan.strategies.memory import backward_working_set

    step = step_shape(plan, prof, cl)
    # (the final norm's input is the residual stream: float32 under autocast)
    head_tok = prof.act_bytes_per_token_head * step.act_scale + (step.resid_b - step.act_b) * prof.hidden
    head = head_tok * step.rows / plan.tp if load.head else 0.0
    if load.head and plan.pp > 1:
        head -= step.act_b * prof.vocab_size * step.rows  # (the stage's output, held through its backward)
    return backward_working_set(step, load, head)


def test_full_checkpointing_peaks_at_the_loss_or_late_in_the_backward():
    prof = llama(layers=8)
    cl = load_cluster("h100:1")
    plan = Plan(param_dtype="bfloat16", ac="full", microbatch_size=2)
    est = estimate(plan, prof, cl)
    tokens, n = 2 * prof.seq_len, prof.num_layers
    # Korthikanti: 2 s b h per block; under autocast the residual stream is float32: 4 s b h
    block_input = 4 * prof.hidden * tokens
    # the loss's moment: every block's input, the head's (its norm's input float32), the loss's
    # working set; no gradient yet
    loss = block_input * n + (prof.act_bytes_per_token_head + 2 * prof.hidden) * tokens
    loss += _working_set(plan, prof, cl, rank_loads(plan, n)[0])
    # inside the feed-forward of the i-th block of the backward: the inputs of the blocks not yet
    # done, the recomputed block, two f-wide gradients net of what its backward freed (SwiGLU), the
    # float32 gradients of the i - 1 blocks done and of the head and the block's down-projection
    # (made before); autocast's recomputed block also keeps its norms' float32 inputs (2 h more
    # each) and a bf16 cast of a norm's output per q, k, v, w1, w3 (3 more)
    recomputed = (prof.act_bytes_per_token_block["none"] + 2 * 2 * prof.hidden + 3 * 2 * prof.hidden) * tokens
    recomputed += 2 * prof.ffn_hidden * 2 * tokens
    first_grads = 4 * (prof.params_head + prof.hidden * prof.ffn_hidden)
    late = [block_input * (n - i + 1) + recomputed + first_grads + (i - 1) * 4 * prof.params_per_block
            for i in (n - 1, n)]
    peak = est.memory_breakdown["grads"] + est.memory_breakdown["activations"]
    assert peak == pytest.approx(max(loss, *late), rel=1e-6)


def test_sequence_parallel_divides_activations_by_tp():
    prof = llama(layers=8)
    cl = load_cluster("h100:4")
    sp = estimate(Plan(tp=4, sp=True), prof, cl)
    one = load_cluster("h100:1")
    single = estimate(Plan(), prof, one)
    load = rank_loads(Plan(), prof.num_layers)[0]
    saved = single.memory_breakdown["activations"] - _working_set(Plan(), prof, one, load)
    # everything the blocks and the head keep, over tp (the attention's and the feed-forward's
    # all-gathered inputs kept as shards, gathered again in the backward); beyond it the first
    # block's input, a view of the embedding's all-reduced output: the whole sequence (float32 here)
    first = prof.hidden * 4 * (1 - 1 / 4) * prof.seq_len
    assert sp.memory_breakdown["activations"] == pytest.approx(
        saved / 4 + first + _working_set(Plan(tp=4, sp=True), prof, cl, load), rel=1e-6)
    # compiled, the column-wise layers keep those inputs whole on every rank: 2 h per token per block
    compiled = estimate(Plan(tp=4, sp=True, compile=True), prof, cl)
    gathered = 2 * prof.hidden * 4 * (1 - 1 / 4) * prof.seq_len * prof.num_layers
    assert compiled.memory_breakdown["activations"] == pytest.approx(
        sp.memory_breakdown["activations"] + gathered, rel=1e-6)


def test_tp_traffic_is_ten_activation_collectives_per_block_plus_latency_bound_ones():
    """Megatron's eight of sequence parallelism and the two all-gathers of the inputs it kept as shards."""
    prof = llama(layers=8)
    cl = load_cluster("h100:1x4")
    plan = Plan(param_dtype="bfloat16", tp=4, sp=True)
    est = estimate(plan, prof, cl)
    act = prof.seq_len * prof.hidden * 2
    ag = collective_time("all_gather", act, 4, 1, cl.groups[0])
    small = collective_time("all_gather", 64.0, 4, 1, cl.groups[0])
    n = step_counts(plan, prof)
    assert n.tp_small_per_microbatch == 8 * (4 + 8) + 16 and n.tp_small_per_step == 8 * 6 + 4
    expect = ((8 + 2) * prof.num_layers * ag + (n.tp_small_per_microbatch + n.tp_small_per_step) * small)
    assert est.time_breakdown["tp"] == pytest.approx(expect * DEFAULT_CONSTANTS.tp_exposed)


def test_degrees_must_match_the_cluster():
    with pytest.raises(ConfigError) as err:
        estimate(Plan(dp_shard=4), llama(), load_cluster("h100:8"))
    assert err.value.field == "degrees"


# ---- properties -----------------------------------------------------------------------------------
profiles = st.builds(
    lambda layers, width, heads_pow, kv_div, vocab: analytic_profile(
        "p", "llama", layers=layers, hidden=width * 2**heads_pow, heads=2**heads_pow,
        kv_heads=max(1, 2**heads_pow // kv_div), vocab=vocab, seq_len=1024),
    st.integers(2, 64), st.sampled_from([64, 128]), st.integers(1, 6), st.sampled_from([1, 2, 4]),
    st.integers(1000, 200000),
)
plans = st.builds(
    Plan,
    dp_replicate=st.sampled_from([1, 2, 4]), dp_shard=st.sampled_from([1, 2, 4, 8]), tp=st.sampled_from([1, 2]),
    pp=st.sampled_from([1, 2]), offload=st.sampled_from(["none", "optimizer", "params"]),
    num_microbatches=st.sampled_from([2, 4]),
)


def _states(plan, prof):
    return sum(model_state_bytes(plan, prof).values())


@settings(max_examples=200, deadline=None)
@given(prof=profiles, plan=plans)
def test_more_sharding_never_increases_model_state_memory(prof, plan):
    base = _states(plan, prof)
    assert _states(dataclasses.replace(plan, dp_shard=plan.dp_shard * 2), prof) <= base
    if prof.num_heads % (plan.tp * 2) == 0 and prof.num_kv_heads % (plan.tp * 2) == 0:
        assert _states(dataclasses.replace(plan, tp=plan.tp * 2), prof) <= base
    if plan.dp_shard == 1 and plan.pp * 2 <= prof.num_layers:
        assert _states(dataclasses.replace(plan, pp=plan.pp * 2), prof) <= base
    order = ["none", "optimizer", "params"]
    for stronger in order[order.index(plan.offload) + 1:]:
        assert _states(dataclasses.replace(plan, offload=stronger), prof) <= base


@settings(max_examples=100, deadline=None)
@given(prof=profiles, plan=plans)
def test_estimates_are_finite_and_positive(prof, plan):
    if plan.pp > prof.num_layers:
        return
    cl = load_cluster(f"h100:{plan.world_size}x1")
    est = estimate(plan, prof, cl)
    assert math.isfinite(est.step_time_s) and est.step_time_s > 0
    assert all(v >= 0 for v in est.time_breakdown.values())
    assert est.memory_bytes_per_rank == pytest.approx(sum(est.memory_breakdown.values()), abs=16)


def test_mixed_cluster_runs_at_the_slowest_device_and_mfu_counts_every_peak():
    prof = llama()
    mixed = estimate(Plan(param_dtype="bfloat16", dp_shard=16), prof, load_cluster("h100:1x8+a100:1x8"))
    a100 = estimate(Plan(param_dtype="bfloat16", dp_shard=16), prof, load_cluster("a100:2x8"))
    assert mixed.step_time_s == pytest.approx(a100.step_time_s, rel=0.05)
    assert mixed.mfu == pytest.approx(mixed.tokens_per_s * prof.flops_per_token / (8 * 989e12 + 8 * 312e12))


def test_offload_must_fit_in_the_nodes_host_memory():
    from dtorch.cluster import load_cluster
    from dtorch.model import profile
    from dtorch.plan.cost import estimate
    from dtorch.plan.plan import Plan

    prof = profile("llama3-405b", 8192)
    plan = Plan(dp_shard=2, microbatch_size=1, num_microbatches=4, ac="full", offload="params")
    est = estimate(plan, prof, load_cluster("h100:1x2"))
    # 405B x 16 bytes / 2 ranks x 2 ranks per node = 6.5 TB > the 2 TiB of a DGX H100
    assert abs(est.host_bytes_per_rank - 16 * prof.params_total / 2) / (8 * prof.params_total) < 0.01
    assert not est.fits
    assert "host memory" in est.notes[0]
    small = estimate(plan, profile("llama3-8b", 8192), load_cluster("h100:1x2"))
    assert small.host_bytes_per_rank > 0 and small.fits


def _with_host_overhead(cluster, op_s: float, dtensor_s: float = 0.0):
    import dataclasses

    g = cluster.groups[0]
    dev = dataclasses.replace(g.device, op_overhead_s=op_s, dtensor_op_overhead_s=dtensor_s)
    return dataclasses.replace(cluster, groups=[dataclasses.replace(g, device=dev)])


def test_host_overhead_adds_on_cpu_and_hides_under_gpu_kernels():
    prof = llama(layers=4, hidden=256, heads=8, kv=4, ffn=1024, seq=128, vocab=1000)
    plan = Plan(microbatch_size=1, num_microbatches=2)
    n = step_counts(plan, prof, "cpu")
    cpu = local_cluster(1, calibrated=False)
    base = estimate(plan, prof, _with_host_overhead(cpu, 0.0), "float32")
    slow = estimate(plan, prof, _with_host_overhead(cpu, 1e-4), "float32")
    expect = 1e-4 * (2 * n.ops_per_microbatch + n.optimizer_ops)
    assert slow.step_time_s - base.step_time_s == pytest.approx(expect, rel=1e-9)
    assert slow.time_breakdown["host"] == pytest.approx(1e-4 * 2 * n.ops_per_microbatch)
    # an H100's host runs ahead of its kernels: 5 us per op is hidden under a big model's GEMMs
    gpu = load_cluster("h100:1")
    big = llama(layers=4)
    assert estimate(plan, big, _with_host_overhead(gpu, 5e-6)).step_time_s == pytest.approx(
        estimate(plan, big, gpu).step_time_s)


def test_operator_counts_follow_microbatches_recompute_and_stages():
    prof = llama(layers=4)
    none = step_counts(Plan(), prof, "cpu")
    full = step_counts(Plan(ac="full"), prof, "cpu")
    ob = prof.ops_per_block or DEFAULT_CONSTANTS.default_ops_per_block
    detach = ob * DEFAULT_CONSTANTS.checkpoint_detach_ops_per_forward_op
    assert full.ops_per_microbatch - none.ops_per_microbatch == pytest.approx(4 * (ob + detach))
    # DTorch's selective policy re-runs all but the 7 linear layers and the attention kernel
    sel = step_counts(Plan(ac="selective"), prof, "cpu")
    assert sel.ops_per_microbatch - none.ops_per_microbatch == pytest.approx(4 * (ob - 8 + detach))
    half = step_counts(Plan(pp=2, num_microbatches=2), prof, "cpu")
    assert half.ops_per_microbatch < 0.6 * none.ops_per_microbatch
    assert half.optimizer_ops < 0.6 * none.optimizer_ops
    # DTensor operators: all of them under TP, the optimizer's under FSDP, none under DDP
    assert step_counts(Plan(tp=2), prof).dtensor_ops_per_microbatch > 0
    fsdp = step_counts(Plan(dp_shard=2), prof)
    assert fsdp.dtensor_ops_per_microbatch == 0 and fsdp.dtensor_optimizer_ops == fsdp.optimizer_ops
    assert step_counts(Plan(dp_replicate=2), prof).dtensor_optimizer_ops == 0


def _cpu_node(ranks: int, cores: int):
    import dataclasses

    from dtorch.cluster.spec import Cluster, Link

    cl = local_cluster(1, calibrated=False)
    g = cl.groups[0]
    g = dataclasses.replace(g, devices_per_node=ranks, num_nodes=1, host_cores=cores,
                            intra=Link("shm", 1e9, 1e-3, 1.0, p2p_latency=1e-4))
    return Cluster([g], name=f"cpu:{ranks}on{cores}")


def test_oversubscribed_cpu_bubble_is_the_idle_cores_share_of_the_1f1b_ramp_for_every_schedule():
    prof = llama(layers=4, hidden=256, heads=8, kv=4, ffn=1024, seq=128, vocab=1000)
    busy = _cpu_node(4, 2)
    plans = [Plan(pp=4, num_microbatches=8, schedule=s, virtual_stages=1) for s in ("1f1b", "zero_bubble", "gpipe")]
    bubbles = [estimate(p, prof, busy, "float32").time_breakdown["bubble"] for p in plans]
    assert bubbles[0] == pytest.approx(bubbles[1]) == pytest.approx(bubbles[2])
    # with a core per rank the schedules differ as on GPUs (zero-bubble a third of 1F1B's)
    free = _cpu_node(4, 4)
    b1, bz = (estimate(p, prof, free, "float32").time_breakdown["bubble"] for p in plans[:2])
    assert bz == pytest.approx(b1 / 3)
    # the ramp costs the idle cores' share: half of it with 4 ranks on 2 cores
    e = estimate(plans[0], prof, busy, "float32")
    t_mb = (e.time_breakdown["compute"] + e.time_breakdown["host"]) / 8
    assert bubbles[0] == pytest.approx(3 * t_mb * 2 / 4)


def test_pipeline_sends_pay_the_ring_latency_when_ranks_outnumber_cores():
    prof = llama(layers=4, hidden=256, heads=8, kv=4, ffn=1024, seq=128, vocab=1000)
    plan = Plan(pp=2, num_microbatches=4)
    busy = estimate(plan, prof, _cpu_node(2, 1), "float32").time_breakdown["pp_p2p"]
    free = estimate(plan, prof, _cpu_node(2, 2), "float32").time_breakdown["pp_p2p"]
    messages = 2 * (4 + 1)
    assert busy - free == pytest.approx(messages * (1e-3 - 1e-4), rel=1e-6)


# ---- descriptions of published runs (dtorch.plan.calibration) ----------------------------------
def test_power_capped_peak_follows_the_cube_root_of_power():
    from dtorch.cluster.presets import DEVICES, power_capped

    sxm = DEVICES["h100-sxm"].peak_flops
    # the H100 NVL sheet (same 132 SMs, 400 W): 835 TFLOP/s bf16; the rule lands within 2 %
    nvl = power_capped(sxm, rated_w=700, limit_w=400)["bfloat16"]
    assert abs(nvl / 835e12 - 1) < 0.02
    capped = DEVICES["h100-96gb"].peak_flops
    assert capped["bfloat16"] == pytest.approx(989e12 * (500 / 700) ** (1 / 3))
    assert 835e12 < capped["bfloat16"] < 989e12  # "between SXM and NVL" (torchtitan's footnote)
    assert capped["float8"] / capped["bfloat16"] == pytest.approx(2.0, rel=1e-3)
    assert power_capped(sxm, rated_w=700, limit_w=900) == sxm  # a higher limit buys nothing
    # the HBM is not clocked down
    assert DEVICES["h100-96gb"].memory_bandwidth == 2.4e12


def test_every_second_matmul_selective_recomputes_k_o_w3_and_the_elementwise_forward():
    from dtorch.plan.cost import every_second_matmul_params

    prof = llama(hidden=1024, heads=16, kv=4, ffn=4096)
    assert every_second_matmul_params(prof) == 1024 * 256 + 1024 * 1024 + 1024 * 4096
    cl = load_cluster("h100:1")
    plan = Plan(ac="selective", microbatch_size=2, param_dtype="bfloat16")
    core = estimate(plan, prof, cl)  # Megatron's attention-core recompute (the default)
    op = estimate(plan, prof, cl, selective="every_second_mm")
    no_elem = estimate(plan, prof, cl, selective="every_second_mm", constants=with_constants(elementwise_passes=0.0))
    mm_flops = 2 * 2 * prof.seq_len * prof.num_layers * every_second_matmul_params(prof)
    assert no_elem.time_breakdown["recompute"] == pytest.approx(mm_flops / (989e12 * no_elem.efficiency))
    assert op.time_breakdown["recompute"] > no_elem.time_breakdown["recompute"]  # + element-wise forward
    assert op.time_breakdown["compute"] == pytest.approx(core.time_breakdown["compute"])
    with pytest.raises(ConfigError, match="selective"):
        estimate(plan, prof, cl, selective="every_other")


def test_float8_runs_cast_operands_keep_the_head_in_bf16_and_need_fp8_hardware():
    from dtorch.plan.cost import float8_cast_bytes_per_token_block

    prof = llama()
    cl = load_cluster("h100:1")
    plan = Plan(microbatch_size=2, param_dtype="bfloat16")
    c0 = with_constants(elementwise_passes=0.0)
    bf16 = estimate(plan, prof, cl, constants=c0)
    f8 = estimate(plan, prof, cl, "float8", compiled=True, constants=c0)
    tokens = 2 * prof.seq_len
    attn = tokens * prof.num_layers * 3 * 4.0 * prof.hidden * prof.seq_len
    head = tokens * prof.flops_per_token_head
    linear = tokens * prof.num_layers * prof.flops_per_token_block - attn
    speed = 989e12 * bf16.efficiency
    casts = tokens * prof.num_layers * float8_cast_bytes_per_token_block(prof, compiled=True) / 3.35e12
    attn_speed = 989e12 * attention_efficiency("H100-SXM-80GB", "sdpa", prof.hidden / prof.num_heads, prof.seq_len)
    assert f8.time_breakdown["compute"] == pytest.approx(linear / (1979 / 989 * speed) + attn / attn_speed
                                                         + head / speed + casts)
    assert float8_cast_bytes_per_token_block(prof, compiled=False) > float8_cast_bytes_per_token_block(prof, True)
    with pytest.raises(ConfigError, match="float8"):
        estimate(plan, prof, load_cluster("a100:1"), "float8")


def _with_link(cluster, **fields):
    g = cluster.groups[0]
    return dataclasses.replace(cluster, groups=(dataclasses.replace(g, intra=dataclasses.replace(g.intra, **fields)),))


def test_measured_fsdp_unit_cost_is_paid_per_unit_and_microbatch_on_a_cpu():
    prof = llama(layers=4, hidden=256, heads=8, kv=4, ffn=1024, seq=128, vocab=1000)
    cpu = local_cluster(2, calibrated=False)
    measured = _with_link(cpu, unit_gather_s=1e-3, unit_reduce_s=3e-3)
    for plan, gathers in ((Plan(dp_shard=2, microbatch_size=1, num_microbatches=2, reshard_after_forward=False), 1),
                          (Plan(dp_shard=2, microbatch_size=1, num_microbatches=2), 2)):
        ring = estimate(plan, prof, cpu, "float32").time_breakdown["fsdp"]
        fixed = estimate(plan, prof, measured, "float32").time_breakdown["fsdp"]
        # 2 micro-batches x (4 blocks + the root) x (gathers x 1 ms + 3 ms), in place of the ring latencies
        ag, rs = (collective_time(k, 1.0, 2, 1, cpu.groups[0]) for k in ("all_gather", "reduce_scatter"))
        assert fixed - 2 * 5 * (gathers * 1e-3 + 3e-3) == pytest.approx(
            ring - 2 * 4 * (gathers * ag + rs), rel=0.05, abs=2e-4)
    # plain DDP has no FSDP unit to pay for
    ddp = Plan(dp_replicate=2)
    assert estimate(ddp, prof, measured, "float32").step_time_s == estimate(ddp, prof, cpu, "float32").step_time_s


def test_measured_functional_latency_replaces_the_ring_latency_of_tp_and_cp_collectives():
    from dtorch.plan.comm import functional_time

    g = local_cluster(4, calibrated=False).groups[0]
    m = dataclasses.replace(g, intra=dataclasses.replace(g.intra, func_latency_s=2e-3))
    nbytes = 1e6
    bytes_part = collective_time("all_gather", nbytes, 2, 1, g) - collective_time("all_gather", 1.0, 2, 1, g)
    assert functional_time("all_gather", nbytes, 2, 1, m) == pytest.approx(bytes_part + 2e-3)
    # per ring step: an axis of 4 pays three, an all-reduce twice as many
    assert functional_time("all_gather", 64.0, 4, 1, m) == pytest.approx(
        collective_time("all_gather", 64.0, 4, 1, g) - collective_time("all_gather", 1.0, 4, 1, g) + 3 * 2e-3)
    assert functional_time("all_reduce", 64.0, 2, 1, m) == pytest.approx(
        collective_time("all_reduce", 64.0, 2, 1, g) - collective_time("all_reduce", 1.0, 2, 1, g) + 2 * 2e-3)
    # unmeasured: the ring fit as before
    assert functional_time("all_gather", nbytes, 2, 1, g) == collective_time("all_gather", nbytes, 2, 1, g)


def test_cpu_optimizer_step_runs_at_the_probed_adamw_rate_of_the_executors_kernel():
    prof = llama(layers=4, hidden=256, heads=8, kv=4, ffn=1024, seq=128, vocab=1000)
    cpu = local_cluster(1, calibrated=False)
    g = cpu.groups[0]
    measured = dataclasses.replace(cpu, groups=(dataclasses.replace(g, host_adam_loop_params_per_s=1e8),))
    plan = Plan()
    base, slow = (estimate(plan, prof, c, "float32").time_breakdown["optimizer"] for c in (cpu, measured))
    host = base - prof.params_total * DEFAULT_CONSTANTS.optimizer_bytes_per_param / (g.device.memory_bandwidth * 0.8)
    assert slow == pytest.approx(prof.params_total / 1e8 + host, rel=1e-6)


def test_fsdp_probed_per_byte_prices_a_cpu_fsdp_unit_by_its_bytes_in_place_of_the_ring():
    prof = llama(layers=4, hidden=256, heads=8, kv=4, ffn=1024, seq=128, vocab=1000)
    cpu = local_cluster(2, calibrated=False)
    measured = _with_link(cpu, unit_gather_s=1e-3, unit_reduce_s=2e-3, unit_gather_s_per_byte=1e-9,
                          unit_reduce_s_per_byte=3e-9)
    plan = Plan(dp_shard=2, microbatch_size=1, num_microbatches=2, reshard_after_forward=False)
    est = estimate(plan, prof, measured, "float32")
    p_stage = prof.params_total  # one stage, tp=1: every parameter of the model, 4 bytes each
    per_mb = 5 * 1e-3 + 1e-9 * 4 * p_stage + 5 * 2e-3 + 3e-9 * 4 * p_stage
    assert est.time_breakdown["fsdp"] == pytest.approx(2 * per_mb, rel=1e-6)
    # resharding gathers twice per micro-batch
    twice = estimate(dataclasses.replace(plan, reshard_after_forward=True), prof, measured, "float32")
    assert twice.time_breakdown["fsdp"] == pytest.approx(2 * (per_mb + 5 * 1e-3 + 1e-9 * 4 * p_stage), rel=1e-6)
