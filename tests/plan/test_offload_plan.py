"""The planner's memory tiers (offload=optimizer, optimizer_nvme): offered only where the cheaper
levels fit nothing, priced with the cluster's disk, bounded by its host memory and disk, explained,
and suggested when nothing fits; priced from the probed host figures, overlapped by the executor's rule.
Analytic profiles only: about 5 s."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dtorch.cluster import load_cluster
from dtorch.cluster.calibration_store import (
    CALIBRATION_VERSION,
    apply_calibration,
    read_calibration,
    record_disk,
)
from dtorch.plan.cost import DEFAULT_CONSTANTS, estimate
from dtorch.plan.explain import explain
from dtorch.plan.plan import Plan
from dtorch.plan.profiles import analytic_profile
from dtorch.plan.search import search

GiB = 2**30
# an 8B Llama cut to 26 blocks (6.7B): 18 B/param of model state (AdamW's moments, float32 masters and
# gradients, autocast's bf16 weight copies: 120 GB) does not fit one 80 GB H100; 10 B/param does
P8B = analytic_profile("t8b", "llama", layers=26, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                       seq_len=2048)


def _one_gpu(**group):
    cl = load_cluster("h100:1")
    return dataclasses.replace(cl, groups=[dataclasses.replace(cl.groups[0], **group)])


def test_host_tier_is_chosen_where_nothing_fits_in_device_memory():
    cl = _one_gpu(host_memory_bytes=2048 * GiB)
    r = search(P8B, cl, global_batch=8, top_k=3)
    assert r.ranked, r.suggestions
    plan, est = r.best
    assert plan.offload == "optimizer" and est.fits
    assert est.memory_breakdown["optimizer"] == 0 and est.host_bytes_per_rank >= 12 * P8B.params_total
    # the same plan in memory needs 8 B/param more device memory than there is
    none = estimate(dataclasses.replace(plan, offload="none"), P8B, cl)
    assert none.memory_bytes_per_rank - est.memory_bytes_per_rank >= 8 * P8B.params_total
    assert not none.fits
    text = explain(r)
    assert "offload: AdamW states (8 B/param) in host memory" in text and "s per step" in text


def test_cheaper_levels_first_the_nvme_tier_only_where_the_host_tier_does_not_fit_host_memory():
    small = _one_gpu(host_memory_bytes=128 * GiB)  # host tier: 12 B/param = 96 GB > 90 % of it? no: fits
    assert search(P8B, small, global_batch=8, top_k=1).best[0].offload == "optimizer"
    tight = _one_gpu(host_memory_bytes=72 * GiB, disk_bytes=2 * 10**12)  # host tier does not fit, NVMe does
    r = search(P8B, tight, global_batch=8, top_k=1)
    plan, est = r.best
    assert plan.offload == "optimizer_nvme"
    assert est.disk_bytes_per_rank == int(8 * P8B.params_total)
    assert est.host_bytes_per_rank < 0.9 * 72 * GiB
    host = estimate(dataclasses.replace(plan, offload="optimizer"), P8B, tight)
    assert not host.fits and "host memory" in host.notes[0]
    assert est.step_time_s > host.step_time_s  # the disk is slower than host memory
    text = explain(r)
    assert "files on the node's local disk" in text and "nominal" in text


def test_disk_bandwidth_comes_from_the_calibration_and_the_disk_budget_is_checked(tmp_path):
    tight = _one_gpu(host_memory_bytes=72 * GiB, disk_bytes=2 * 10**12)
    plan = search(P8B, tight, global_batch=8, top_k=1).best[0]
    nominal = estimate(plan, P8B, tight)
    # `dtorch probe --disk` records its figures in the calibration; the planner reads them
    path = record_disk({"directory": "/nvme", "bytes": 1, "read_bytes_per_s": 8e9, "write_bytes_per_s": 4e9,
                        "read_cached_bytes_per_s": 2e10, "free_bytes": 3 * 10**12}, tmp_path / "c.json")
    doc = read_calibration(path)
    assert doc["disk"]["write_bytes_per_s"] == 4e9
    fast = apply_calibration(_one_gpu(host_memory_bytes=72 * GiB), doc)
    g = fast.groups[0]
    assert (g.disk_read_bytes_per_s, g.disk_write_bytes_per_s, g.disk_bytes) == (8e9, 4e9, 3 * 10**12)
    measured = estimate(plan, P8B, fast)
    assert measured.time_breakdown["offload"] < nominal.time_breakdown["offload"]
    d = 8 * P8B.params_total
    assert nominal.time_breakdown["offload"] >= d / DEFAULT_CONSTANTS.disk_read_bytes_per_s \
        + d / DEFAULT_CONSTANTS.disk_write_bytes_per_s
    # the probe's cycle (a block read while the one before is written back, as the tier runs them)
    # prices the step's I/O where it was measured: all 8 B/param read and written at that rate
    cyc = apply_calibration(_one_gpu(host_memory_bytes=72 * GiB),
                            {**doc, "disk": {**doc["disk"], "read_write_bytes_per_s": 1e9}})
    assert cyc.groups[0].disk_read_write_bytes_per_s == 1e9
    assert estimate(plan, P8B, cyc).time_breakdown["offload"] >= d / 1e9 > measured.time_breakdown["offload"]
    # a disk too small for the files: the plan does not fit, and the note says by how much
    full = estimate(plan, P8B, _one_gpu(host_memory_bytes=72 * GiB, disk_bytes=10 * GiB))
    assert not full.fits and any("local disk per node" in n for n in full.notes)


def test_what_would_make_it_fit_names_the_offload_tiers():
    # offload fixed to none: the suggestion names the tier that fits
    r = search(P8B, _one_gpu(host_memory_bytes=2048 * GiB), global_batch=8, fixed={"offload": "none"}, top_k=1)
    assert not r.ranked
    assert any(s.startswith("offload=optimizer:") for s in r.suggestions), r.suggestions
    # host memory and disk both too small for any tier: the suggestion says how much is needed
    r = search(P8B, _one_gpu(host_memory_bytes=16 * GiB, disk_bytes=10 * GiB), global_batch=8, top_k=1)
    assert not r.ranked
    assert any("GiB of host memory" in s and "offload=" in s for s in r.suggestions), r.suggestions


def test_cluster_file_declares_the_disk(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"name": "x", "groups": [{"device": "h100", "num_nodes": 1, "devices_per_node": 1,
                                                       "disk_bytes": 5e11, "disk_read_bytes_per_s": 3e9,
                                                       "disk_write_bytes_per_s": 1.5e9}]}))
    g = load_cluster(str(f)).groups[0]
    assert (g.disk_bytes, g.disk_read_bytes_per_s, g.disk_write_bytes_per_s) == (5 * 10**11, 3e9, 1.5e9)
    assert Plan(offload="optimizer_nvme").describe().endswith("offload=optimizer_nvme")


def test_host_tier_is_priced_from_the_probed_cpu_adam_and_copy_bandwidth():
    """`dtorch probe`'s host figures (calibration `host_optimizer`) set the kernel and copy terms:
    the kernel at the measured parameters/s, the copies at the slower pinned direction."""
    plan = Plan(microbatch_size=1, num_microbatches=8, ac="full", offload="optimizer")
    cl = _one_gpu(host_memory_bytes=2048 * GiB)
    doc = {"version": CALIBRATION_VERSION, "device_kind": "cuda",
           "host_optimizer": {"adam_fused_params_per_s": 2e9, "adam_loop_params_per_s": 1e8,
                              "h2d_bytes_per_s": 20e9, "d2h_bytes_per_s": 16e9}}
    measured = apply_calibration(cl, doc)
    g = measured.groups[0]
    assert (g.host_adam_params_per_s, g.host_link_bytes_per_s) == (2e9, 16e9)
    t = estimate(plan, P8B, measured).time_breakdown["offload"]
    n = P8B.params_total
    assert abs(t - (n / 2e9 + 8 * n / 16e9)) < 1e-6 * t
    faster = apply_calibration(cl, {**doc, "host_optimizer": {**doc["host_optimizer"], "adam_fused_params_per_s": 4e9}})
    assert estimate(plan, P8B, faster).time_breakdown["offload"] < t - n / 4e9 * 0.99
    # unmeasured: the nominal figures (unchanged from before the probe measured them)
    c = DEFAULT_CONSTANTS
    assert abs(estimate(plan, P8B, cl).time_breakdown["offload"]
               - n * (c.optimizer_bytes_per_param / c.cpu_adam_bytes_per_s + 8 / c.host_link_bandwidth)) < 1e-3


def test_overlap_rule_is_the_executors_and_hides_only_behind_an_accelerators_backward():
    """Without clipping the executor steps blocks during the backward (`step_overlaps_backward`,
    asked by the trainer too): the planner then takes the last micro-batch's backward off the
    tier's time, down to the block released last; not on a CPU, whose cores the two share (the
    benchmark measured the backward growing by what the worker did)."""
    from dtorch.cluster.local import local_cluster
    from dtorch.plan.cost import with_constants
    from dtorch.plan.strategies.memory import step_overlaps_backward

    host = Plan(microbatch_size=1, num_microbatches=8, ac="full", offload="optimizer")
    assert step_overlaps_backward(host, grad_clipping=False)
    assert not step_overlaps_backward(host, grad_clipping=True)
    for other in (dict(dp_replicate=2), dict(tp=2), dict(pp=2), dict(cp=2), dict(offload="none"),
                  dict(offload="params", dp_shard=2)):
        assert not step_overlaps_backward(dataclasses.replace(host, **other), grad_clipping=False), other
    assert step_overlaps_backward(dataclasses.replace(host, dp_shard=2), grad_clipping=False)  # FSDP
    assert step_overlaps_backward(dataclasses.replace(host, dp_replicate=2, dp_shard=2), grad_clipping=False)
    cl = _one_gpu(host_memory_bytes=2048 * GiB)
    clip = estimate(host, P8B, cl).time_breakdown
    free = estimate(host, P8B, cl, constants=with_constants(grad_clipping=False)).time_breakdown
    assert free["offload"] < clip["offload"] and free["offload"] >= clip["offload"] * 0.01
    cpu = local_cluster(1, calibrated=False)
    p1 = Plan(microbatch_size=1, offload="optimizer")  # many blocks: the last is a small share
    a = estimate(p1, P8B, cpu).time_breakdown["offload"]
    b = estimate(p1, P8B, cpu, constants=with_constants(grad_clipping=False)).time_breakdown["offload"]
    assert a == b
    # the NVMe tier on a CPU: the disk is a device of its own and works during the backward (here
    # longer than the disk's share), the copies and the kernel on the backward's cores do not hide
    from dtorch.plan.cost import step_shape
    from dtorch.plan.strategies.memory import MEMORY
    from dtorch.plan.strategies.pipeline import distinct_loads

    nv = Plan(microbatch_size=1, offload="optimizer_nvme")
    clip = estimate(nv, P8B, cpu).time_breakdown["offload"]
    free = estimate(nv, P8B, cpu, constants=with_constants(grad_clipping=False)).time_breakdown["offload"]
    step = step_shape(nv, P8B, cpu)
    load = distinct_loads(nv, P8B.num_layers)[0]
    t = MEMORY.tier_terms(step, load, step.p_stage(load) / step.fs)
    assert t["disk_s"] > t["copies_s"] + t["kernel_s"]  # (disk-bound with the nominal disk)
    assert clip == pytest.approx(t["disk_s"] + t["first_read_s"] + t["last_write_s"])
    assert free == pytest.approx(t["copies_s"] + t["kernel_s"] + t["last_write_s"])


def test_plan_command_prices_the_clipping_dtorch_train_runs_with(capsys):
    """`dtorch plan --max-grad-norm` is `dtorch train`'s flag: 0 (no clipping) lets the tier step during
    the backward, and the plan prices it with the constants the trainer sets for that run."""

    from dtorch.cli import main
    from dtorch.cli.plan import _plan_constants
    from dtorch.train.optim import AdamW
    from dtorch.train.trainer import Trainer

    # (26 of the 8B's blocks: the whole 8B with autocast's bf16 weight copies does not fit one H100 even so)
    base = ["plan", "--model", "llama3-8b:layers=26", "--cluster", "h100:1", "--seq-len", "2048", "--global-batch", "8",
            "--fix", "offload=optimizer", "--json"]
    off = {}
    for norm in ("1.0", "0"):
        assert main([*base, "--max-grad-norm", norm]) == 0
        off[norm] = json.loads(capsys.readouterr().out)["predicted"]["time_breakdown"]["offload"]
    assert off["0"] < off["1.0"]
    spec = AdamW(lr=3e-3, weight_decay=0.0)  # dtorch train's optimizer
    for norm in (None, 1.0):
        trainer = Trainer(model=lambda: None, global_batch=8, seq_len=64, max_grad_norm=norm, optimizer=spec,
                          console=False)  # nothing built: the constants its plan search would use
        assert _plan_constants(norm) == trainer.resolver._cost_constants()
    assert main([*base, "--max-grad-norm", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "max_grad_norm=-1" in err
