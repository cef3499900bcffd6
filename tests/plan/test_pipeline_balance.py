"""The cost of a pipeline plan follows its stage partition; the search tries uneven ones."""

from __future__ import annotations

import dataclasses

import pytest

from dtorch.cluster import load_cluster, local_cluster
from dtorch.plan.cost import balanced_partition, estimate, partition, rank_loads
from dtorch.plan.plan import Plan
from dtorch.plan.profiles import get_profile
from dtorch.plan.search import search


def test_partition_is_what_the_executor_applies():
    from dtorch.parallel.pipeline import layer_partition

    for plan, L in [(Plan(pp=2), 7), (Plan(pp=4, virtual_stages=2, schedule="interleaved_1f1b", num_microbatches=4), 19),
                    (Plan(pp=2, layer_partition=[5, 2]), 7)]:
        assert partition(plan, L) == layer_partition(plan, L)
    loads = rank_loads(Plan(pp=2, virtual_stages=2, schedule="interleaved_1f1b", num_microbatches=2,
                            layer_partition=[3, 3, 3, 1]), 10)
    assert [(ld.blocks, ld.embedding, ld.head) for ld in loads] == [(6, True, False), (4, False, True)]


def test_a_lopsided_partition_costs_more_than_the_even_split():
    prof = get_profile("llama3-8b", 8192)
    cl = load_cluster("h100:1x2")
    even = Plan(pp=2, num_microbatches=8, ac="full", param_dtype="bfloat16")
    lop = dataclasses.replace(even, layer_partition=[31, 1])
    e_even, e_lop = estimate(even, prof, cl), estimate(lop, prof, cl)
    assert e_lop.step_time_s > 1.5 * e_even.step_time_s
    # the fullest rank holds 31 blocks' parameters (and the embedding) where the even split's holds 16
    # and the head (whose bf16 autocast copy counts too, the embedding's is never cast)
    assert e_lop.memory_breakdown["params"] > 1.7 * e_even.memory_breakdown["params"]


def test_balanced_partition_gives_the_head_stage_fewer_blocks():
    assert balanced_partition(4, 32, head_blocks=0.0) == [8, 8, 8, 8]
    sizes = balanced_partition(4, 32, head_blocks=2.4)
    assert sum(sizes) == 32 and sizes[-1] < 8 and max(sizes) - min(sizes) <= 3
    assert max(s + (2.4 if i == 3 else 0) for i, s in enumerate(sizes)) < 8 + 2.4
    assert balanced_partition(3, 3, head_blocks=5.0) == [1, 1, 1]  # every stage keeps a block


def test_search_picks_an_uneven_partition_when_the_head_is_heavy():
    # a 128k vocabulary on a small model: the output head weighs several blocks on the last stage
    prof = get_profile("llama:layers=8,dim=1024,heads=16,kv_heads=8,ffn=4096,vocab=128256,seq=2048", 2048)
    cl = load_cluster("h100:1x4")
    r = search(prof, cl, global_batch=32, fixed={"pp": 4, "dp_shard": 1, "tp": 1, "cp": 1}, top_k=3)
    plan, est = r.best
    assert plan.layer_partition is not None and plan.layer_partition[-1] < plan.layer_partition[0]
    even = estimate(dataclasses.replace(plan, layer_partition=None), prof, cl)
    assert est.step_time_s < even.step_time_s


def test_cp_key_value_traffic_is_not_hidden_behind_attention():
    prof = get_profile("llama3-8b", 8192)
    cl = load_cluster("h100:1x2")
    est = estimate(Plan(cp=2, param_dtype="bfloat16", ac="full"), prof, cl)
    assert est.time_breakdown["cp"] > 0


def test_plan_on_this_machine_models_the_workers_train_starts(monkeypatch):
    monkeypatch.setenv("DTORCH_NO_CALIBRATION", "1")
    prof = get_profile("gpt:layers=4,hidden=128,heads=4,vocab=256,seq=256", 128)
    workload = (prof.hidden, prof.num_heads, prof.seq_len)
    detect = load_cluster("detect", workload=workload)
    assert detect.name == "local:1x2" and detect.world_size == 2
    train = local_cluster(2, workload=workload)
    a = search(prof, detect, global_batch=16).best
    b = search(prof, train, global_batch=16).best
    assert a[0].describe() == b[0].describe()
    assert a[1].step_time_s == pytest.approx(b[1].step_time_s)


def test_zero_bubble_with_selective_checkpointing_is_not_offered():
    """torch 2.13's selective checkpointing allows one backward per region; zero-bubble runs two."""
    from dtorch.plan.limits import unsupported

    assert "selective" in unsupported(Plan(pp=2, schedule="zero_bubble", ac="selective", num_microbatches=2))
    assert unsupported(Plan(pp=2, schedule="zero_bubble", ac="full", num_microbatches=2)) is None
    prof = get_profile("gpt:layers=4,hidden=128,heads=4,vocab=256,seq=256", 256)
    r = search(prof, load_cluster("cpu:1x2"), global_batch=16, top_k=20, fixed={"pp": 2})
    assert all(not (p.schedule == "zero_bubble" and p.ac == "selective")
               for p, _ in [*r.ranked, *r.best_by_family.values()])
