"""Precision is a searched, fixable plan dimension, priced by what the hardware does in each dtype."""

from __future__ import annotations

import dataclasses

import pytest

from dtorch.cluster import load_cluster
from dtorch.cluster.spec import Cluster, DeviceType, Link, NodeGroup
from dtorch.errors import ConfigError
from dtorch.plan.cost import estimate
from dtorch.plan.explain import explain
from dtorch.plan.plan import Plan
from dtorch.plan.profiles import get_profile
from dtorch.plan.search import parse_fix, search

GPT = "gpt:layers=4,hidden=128,heads=4,vocab=256,seq=256"


def _cpu(bf16_speed: float, ranks: int = 2) -> Cluster:
    """A 2-rank CPU node whose bfloat16 trains at `bf16_speed` x float32's (arithmetic and element-wise)."""
    speed = {"float32": 1.0, "bfloat16": bf16_speed, "float16": 0.05}
    dev = DeviceType(name=f"cpu-bf16x{bf16_speed}", peak_flops={d: 4e10 * r for d, r in speed.items()},
                     memory_bytes=8 * 2**30, memory_bandwidth=1e10, matmul_efficiency=0.5, kind="cpu",
                     op_overhead_s=5e-6, dtensor_op_overhead_s=1e-5, elementwise_speed=speed)
    return Cluster([NodeGroup(dev, 1, ranks, Link("shm", 2e9, 2e-4, 1.0), Link("ethernet", 1e9, 5e-5, 0.7),
                              16 * 2**30, ranks)], name="cpu-test")


def test_emulated_bfloat16_loses_and_native_fast_bfloat16_wins_on_a_cpu():
    prof = get_profile(GPT, 128)
    slow = search(prof, _cpu(0.05), global_batch=16)
    assert slow.best[0].param_dtype == "float32" and slow.best[0].reduce_dtype == "float32"
    fast = search(prof, _cpu(3.0), global_batch=16)
    assert fast.best[0].param_dtype == "bfloat16"
    # the explanation says why, with the loser's cost
    text = explain(slow)
    assert "precision: float32 compute" in text and "bfloat16/float32 +" in text


def test_a_few_percent_is_not_worth_reduced_precision():
    prof = get_profile(GPT, 128)
    r = search(prof, _cpu(1.01), global_batch=16)
    assert r.best[0].param_dtype == "float32"
    assert "bfloat16/float32" in r.best_by_precision


def test_gpu_trains_in_bfloat16_and_says_float32_was_not_worth_searching():
    r = search(get_profile("llama3-8b", 8192), load_cluster("h100:1x8"), global_batch=64)
    assert r.best[0].param_dtype == "bfloat16"
    assert any("float32 not searched" in n for n in r.notes)
    assert all(p.param_dtype != "float16" for p, _ in r.ranked)  # no loss scaling: never offered


def test_precision_can_be_fixed_like_any_field():
    prof = get_profile("llama3-8b", 8192)
    fixed = parse_fix("param_dtype=fp32,reduce_dtype=float32,tp=8")
    r = search(prof, load_cluster("h100:1x8"), global_batch=8, fixed=fixed)
    assert r.ranked and all((p.param_dtype, p.reduce_dtype) == ("float32", "float32") for p, _ in r.ranked)
    r = search(prof, load_cluster("h100:1x8"), global_batch=64, fixed={"reduce_dtype": "bfloat16"})
    assert all(p.reduce_dtype == "bfloat16" for p, _ in r.ranked)
    with pytest.raises(ConfigError) as err:
        parse_fix("param_dtype=float8")
    assert err.value.field == "param_dtype" and "not implemented" in err.value.fix
    with pytest.raises(ConfigError):
        search(prof, load_cluster("h100:1x8"), global_batch=64, dtype="float8")


def test_the_estimate_prices_the_plans_own_dtype():
    prof = get_profile("llama3-8b", 4096)
    cl = load_cluster("h100:1x8")
    bf = Plan(dp_shard=8, param_dtype="bfloat16")
    fp = dataclasses.replace(bf, param_dtype="float32")
    e_bf, e_fp = estimate(bf, prof, cl), estimate(fp, prof, cl)
    assert e_fp.time_breakdown["compute"] > 10 * e_bf.time_breakdown["compute"]  # 67 vs 989 TFLOP/s
    # twice the bytes: both peak inside the first block's backward, where the head's bytes (and what
    # stays float32 in either dtype among them) are freed and the loss's working set is gone
    assert e_fp.memory_breakdown["activations"] == pytest.approx(2 * e_bf.memory_breakdown["activations"])
    # an fp32 run's MFU is against the fp32 peak it could reach
    assert e_fp.mfu == pytest.approx(e_fp.tokens_per_s * prof.flops_per_token / (8 * 67e12))


def test_ranked_estimates_are_the_plain_estimates_of_their_plans():
    """Nothing credited that does not run: the search's numbers are `estimate(plan)` with no
    float8, torch.compile or async-TP modifier."""
    prof = get_profile("llama3-8b", 8192)
    cl = load_cluster("h100:2x8")
    r = search(prof, cl, global_batch=128, top_k=8)
    for plan, est in [*r.ranked, *r.best_by_family.values()]:
        assert est.step_time_s == estimate(plan, prof, cl).step_time_s
        assert plan.param_dtype in ("float32", "bfloat16")
