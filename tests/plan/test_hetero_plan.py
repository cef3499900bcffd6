"""Planning mixed clusters (issue 14, planner half): per-group speed and memory, uneven pipeline
stages and uneven data-parallel shares, TP/CP groups on one kind of device, bad input.

Pure Python (no torch, no processes): the whole file takes about 5 s."""

from __future__ import annotations

import dataclasses

import pytest

from dtorch.cli import main
from dtorch.cluster.load import cluster_from_dict, load_cluster
from dtorch.cluster.spec import Cluster
from dtorch.errors import ConfigError
from dtorch.plan import hetero, strategies
from dtorch.plan.cost import DEFAULT_CONSTANTS, estimate
from dtorch.plan.explain import explain
from dtorch.plan.plan import Plan
from dtorch.plan.profiles import get_profile
from dtorch.plan.search import _bound, _Mesh, check, precisions, search

GiB = 2**30


def _renamed(cluster: Cluster, k: int, **device) -> Cluster:
    groups = list(cluster.groups)
    groups[k] = dataclasses.replace(groups[k], device=dataclasses.replace(groups[k].device, **device))
    return Cluster(groups, name=cluster.name)


def test_mixed_cluster_budgets_memory_on_each_groups_own_device():
    """The issue's case: on MI300X (192 GB) + H100 (80 GB) the old planner budgeted every rank from
    the MI300X and chose a plan needing 166 GiB per rank; every rank must fit its own device."""
    prof = get_profile("llama3-70b", 4096)
    res = search(prof, load_cluster("mi300x:1x8+h100:1x8"), global_batch=64, top_k=3)
    assert res.ranked
    for plan, est in res.ranked:
        assert est.fits and len(est.groups) == 2
        h100 = next(g for g in est.groups if g["device"].startswith("H100"))
        assert h100["memory_bytes"] <= h100["memory_capacity"] == 80 * GiB, plan.describe()
        assert est.memory_capacity == 80 * GiB  # the tightest rank is reported, against its own device


def test_a_cluster_of_one_device_split_into_groups_costs_the_same_as_one_group():
    """The per-group composition is the single-group estimate when the groups' devices only differ by
    name (each rank's pipeline on its own group, the step waiting for the slowest)."""
    prof = get_profile("llama3-8b", 4096)
    one = load_cluster("h100:4x8")
    two = _renamed(load_cluster("h100:2x8+h100:2x8"), 1, name="H100-other")
    assert not two.homogeneous
    for plan in (Plan(dp_shard=32, microbatch_size=1, num_microbatches=4, param_dtype="bfloat16", ac="full"),
                 Plan(pp=2, dp_replicate=2, dp_shard=2, tp=4, sp=True, microbatch_size=1, num_microbatches=8,
                      schedule="1f1b", param_dtype="bfloat16", layer_partition=[17, 15])):
        a, b = estimate(plan, prof, one), estimate(plan, prof, two)
        assert b.step_time_s == pytest.approx(a.step_time_s, rel=1e-9)
        assert b.memory_bytes_per_rank == pytest.approx(a.memory_bytes_per_rank, rel=1e-6)


def test_same_named_devices_measured_at_different_speeds_are_planned_as_mixed():
    """A cluster file whose groups carry one device name but different measured efficiencies (what
    `dtorch probe` writes for a throttled node) is mixed: the slow group gets fewer blocks."""
    doc = {"groups": [{"device": {"preset": "h100", "matmul_efficiency": 0.7}, "num_nodes": 1},
                      {"device": {"preset": "h100", "matmul_efficiency": 0.35}, "num_nodes": 1}]}
    cl = cluster_from_dict(doc)
    assert not cl.homogeneous and cl.groups[0].device.name == cl.groups[1].device.name
    prof = get_profile("llama3-8b", 4096)
    plan, est = search(prof, cl, global_batch=32, fixed={"pp": 2}, top_k=1).best
    fast, slow = est.groups
    assert plan.layer_partition is not None and fast["blocks"][0] > slow["blocks"][0]
    even = estimate(dataclasses.replace(plan, layer_partition=None), prof, cl)
    assert est.step_time_s < 0.85 * even.step_time_s


def test_dp_shares_follow_the_speed_of_each_data_parallel_rank():
    cl = load_cluster("a100:1x8+h100:1x8")
    shares = hetero.dp_shares(cl, 1, 16, 1, 1, 4)
    assert sum(shares) == 64 and len(set(shares[:8])) == 1 and len(set(shares[8:])) == 1
    a100, h100 = shares[0], shares[8]
    ratio = hetero.group_speed(cl.groups[1]) / hetero.group_speed(cl.groups[0])
    assert h100 > a100 and abs(h100 / a100 - ratio) < 0.6  # 2.6x faster: 2 and 6 of the 4 each
    # a pipelined schedule keeps every rank's count at least pp and in rounds of pp (each stage
    # here holds both kinds: ranks 0-3 A100, 4-7 H100, 8-11 A100, 12-15 H100)
    alt = load_cluster("a100:1x4+h100:1x4+a100:1x4+h100:1x4")
    piped = hetero.dp_shares(alt, 2, 4, 1, 2, 4, "interleaved_1f1b")
    assert piped == [2, 2, 6, 6]
    assert hetero.apportion(10, [1, 1, 8], 1, 2) == [2, 2, 6]


def test_the_search_chooses_uneven_shares_the_executor_applies():
    """DDP of a small model over A100 + H100: the even plan runs every rank at the A100's pace."""
    prof = get_profile("gpt2-small", 1024)
    cl = load_cluster("a100:1x8+h100:1x8")
    res = search(prof, cl, global_batch=64, fixed={"pp": 1, "tp": 1, "dp_shard": 1}, top_k=1)
    plan, est = res.best
    assert plan.dp_shares is not None and sum(plan.dp_shares) == plan.dp * plan.num_microbatches
    assert min(plan.dp_shares[8:]) > max(plan.dp_shares[:8])  # the H100 ranks (8-15) take more
    even = estimate(dataclasses.replace(plan, dp_shares=None), prof, cl)
    assert est.step_time_s < 0.8 * even.step_time_s
    assert "even split" in explain(res) and "micro-batches per step per rank" in explain(res)
    assert not list(strategies.limits(plan))  # the executor runs it as written


def test_the_search_never_ranks_uneven_shares_the_executor_refuses():
    """Uneven shares with expert parallelism are refused by the executor: never ranked."""
    prof = get_profile("gpt2-small", 1024)
    res = search(prof, load_cluster("a100:1x8+h100:1x8"), global_batch=64,
                 fixed={"pp": 1, "tp": 1, "dp_shard": 1}, top_k=3)
    for plan, _ in res.ranked:
        assert not list(strategies.limits(plan)), plan.describe()
    refused = dataclasses.replace(res.best[0], ep=2)
    assert any(lim.field == "dp_shares" for lim in strategies.limits(refused))


def test_tensor_and_context_parallel_groups_never_span_device_types():
    cl = cluster_from_dict({"groups": [{"device": "a100", "devices_per_node": 4},
                                       {"device": "h100", "devices_per_node": 4},
                                       {"device": "a100", "devices_per_node": 8}]})
    prof = get_profile("llama3-8b", 4096)
    res = search(prof, cl, global_batch=32, top_k=5)
    for plan, _ in res.ranked + list(res.best_by_family.values()):
        assert hetero.span_violation(cl, plan.cp, plan.tp) is None, plan.describe()
    bad = Plan(cp=8, dp_shard=2, microbatch_size=1, num_microbatches=16)
    with pytest.raises(ConfigError) as e:
        check(bad, prof, cl)
    assert e.value.field == "cp" and "group 0" in str(e.value) and "group 1" in str(e.value)


@pytest.mark.parametrize("fix, needle", [("tp=8", "group 0 (1 x 4 A100-SXM-80GB) has 4 devices per node"),
                                         ("tp=4,cp=2", "span group 0 (A100-SXM-80GB) and group 1")])
def test_groups_that_cannot_form_the_plan_are_one_line_exit_2(capsys, tmp_path, fix, needle):
    f = tmp_path / "mixed.yaml"
    f.write_text("groups:\n  - {device: a100, devices_per_node: 4}\n  - {device: h100, devices_per_node: 4}\n"
                 "  - {device: a100, devices_per_node: 8}\n")
    args = ["plan", "--model", "llama3-8b", "--cluster", str(f), "--seq-len", "4096", "--global-batch", "32",
            "--fix", fix]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "use " in err


def test_the_lower_bound_holds_on_a_mixed_cluster():
    """Pruning by the bound must never drop a mesh whose uneven plans beat it: the bound runs at the
    cluster's mean speed, which no apportioning can beat."""
    prof = get_profile("gpt2-small", 1024)
    cl = load_cluster("a100:1x8+h100:1x8")
    bg = hetero.bound_group(cl)
    precs, _ = precisions(cl.slowest_group(), {})
    res = search(prof, cl, global_batch=64, top_k=5)
    plans = res.ranked + list(res.best_by_family.values())
    assert any(p.dp_shares for p, _ in plans) and any(p.layer_partition for p, _ in plans)
    for plan, est in plans:
        mesh = _Mesh(plan.pp, plan.dp_replicate, plan.dp_shard, plan.cp, plan.tp)
        assert _bound(mesh, plan.microbatch_size, prof, bg, 64, precs, DEFAULT_CONSTANTS) <= est.step_time_s


def test_the_cluster_file_in_the_docs_loads_as_a_mixed_cluster():
    """docs/heterogeneous.md "cluster file": the format `dtorch probe` targets stays loadable."""
    import re
    from pathlib import Path

    import yaml

    text = (Path(__file__).resolve().parents[2] / "docs" / "heterogeneous.md").read_text()
    doc = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.S).group(1))
    cl = cluster_from_dict(doc)
    assert not cl.homogeneous and [g.num_devices for g in cl.groups] == [24, 8]
    assert hetero.group_speed(cl.groups[1]) < 0.6 * hetero.group_speed(cl.groups[0])
