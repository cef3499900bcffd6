"""Must hold (issue 17): a model that does not fit the device memory a cluster file declares trains
with the planner's offload choice. A CPU cluster file declares a device budget below what the
leanest in-memory plan needs; the Trainer plans on it itself ("auto"), gets the host tier, trains,
and the state it keeps off the device is measured where the tier says (not in the device's share).
A plan saying offload=optimizer_nvme gets the NVMe tier in `offload_dir`, its files the bytes the
planner counted. Cost: about 15 s on 2 shared cores (one gloo process, two short runs).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
from _harness import run_group  # noqa: E402

from dtorch.errors import ConfigError  # noqa: E402

SEQ, BATCH, STEPS = 32, 4, 3


def _factory():
    from dtorch.models import build_model

    return build_model("llama-tiny")


def _cluster_doc(memory_bytes: int) -> dict:
    device = {"name": "cpu-declared", "kind": "cpu", "peak_flops": {"float32": 5e10}, "memory_bytes": memory_bytes,
              "memory_bandwidth": 1e10}
    return {"name": "declared-budget", "groups": [{"device": device, "num_nodes": 1, "devices_per_node": 1,
                                                    "host_memory_bytes": 64 * 2**30}]}


def _worker(case: dict, rank: int) -> dict:
    from dtorch.plan.plan import Plan
    from dtorch.train.optim import AdamW
    from dtorch.train.trainer import Trainer

    plan = Plan(**case["plan"]) if "plan" in case else "auto"
    tr = Trainer(model=_factory, plan=plan, cluster=case.get("cluster"), global_batch=BATCH, seq_len=SEQ,
                 optimizer=AdamW(lr=3e-3), console=False, straggler_every=0, metrics_every=0, seed=1,
                 offload_dir=case.get("dir"))
    res = tr.fit(STEPS)
    params = [p for part in tr.parallel.model_parts for p in part.parameters()]
    out = {"offload": tr.plan.offload, "predicted": tr.plan.predicted, "losses": list(res.losses.values()),
           "kind": [type(o).__name__ for o in tr.optimizers],
           "tier": tr.offload.tier if tr.offload is not None else None,
           "memory": [o.memory() for o in tr.optimizers],
           "param_bytes": sum(p.numel() * p.element_size() for p in params),
           "numel": sum(p.numel() for p in params if p.requires_grad)}
    for o in tr.optimizers:
        o.close()
    return out


def test_a_model_over_the_declared_device_memory_trains_with_the_planners_offload_choice(tmp_path):
    from dtorch.cluster.load import cluster_from_dict
    from dtorch.model import profile_module
    from dtorch.plan.cost import estimate
    from dtorch.plan.plan import Plan
    from dtorch.plan.search import search

    prof = profile_module(_factory, SEQ)
    n = prof.params_total
    roomy = cluster_from_dict(_cluster_doc(2**40))
    lean = dict(microbatch_size=1, num_microbatches=BATCH, ac="full", param_dtype="float32",
                reduce_dtype="float32", seq_len=SEQ, global_batch=BATCH)
    need_none = estimate(Plan(**lean), prof, roomy).memory_bytes_per_rank  # the leanest plan in memory
    budget = int(need_none - 4 * n)  # half the optimizer state short of it
    doc = _cluster_doc(budget)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(doc))
    # the planner, on the declared budget: nothing in memory fits, the host tier does
    declared = cluster_from_dict(doc)
    assert not search(prof, declared, global_batch=BATCH, fixed={"offload": "none"}, top_k=1, suggest=False).ranked
    assert search(prof, declared, global_batch=BATCH, top_k=1).best[0].offload == "optimizer"

    nvme_plan = {**lean, "ac": "none", "offload": "optimizer_nvme"}
    (tmp_path / "nvme").mkdir()
    auto, nvme = [r[0] for r in run_group(1, [{"cluster": str(path)},
                                              {"plan": nvme_plan, "dir": str(tmp_path / "nvme")}], _worker)]
    assert "error" not in auto, auto.get("error")
    assert auto["offload"] == "optimizer" and auto["tier"] == "host" and auto["kind"] == ["OffloadedOptimizer"]
    assert len(auto["losses"]) == STEPS and all(loss == loss and loss < 20 for loss in auto["losses"])
    pred = auto["predicted"]
    states = pred["memory_breakdown"]
    assert states.get("optimizer", 0) == 0 and pred["memory_bytes_per_rank"] <= budget
    # measured: the AdamW state (8 B/param) and the fp32 masters (4 B) live in the tier's host memory ...
    mem = auto["memory"][0]
    assert mem["host_bytes"] >= 12 * auto["numel"] and mem["disk_bytes"] == 0
    assert mem["host_bytes"] <= pred["host_bytes_per_rank"]
    # ... and what stays on the device is the parameters and their gradients (those alive at the peak,
    # as the planner counts them): with its activations, buffers and margin that is within the
    # declared device memory, with the state not
    device = auto["param_bytes"] + states["grads"] + states["activations"] + states["buffers"] + states["margin"]
    assert device <= budget < device + 8 * auto["numel"]

    assert "error" not in nvme, nvme.get("error")
    assert nvme["offload"] == "optimizer_nvme" and nvme["tier"] == "nvme"
    assert nvme["memory"][0]["disk_bytes"] == 8 * nvme["numel"]  # the planner's disk_bytes_per_rank: 8 N
    counted = estimate(Plan(**nvme_plan), prof, roomy)
    assert counted.disk_bytes_per_rank == 8 * nvme["numel"]
    assert 4 * nvme["numel"] <= nvme["memory"][0]["host_bytes"] <= counted.host_bytes_per_rank  # masters + buffers
    assert len(nvme["losses"]) == STEPS and all(loss == loss and loss < 20 for loss in nvme["losses"])
    assert not list((tmp_path / "nvme").iterdir())  # its files were removed


def test_a_plan_with_the_nvme_tier_and_no_directory_is_one_line_naming_the_fix():
    from dtorch.train.offload import OptimizerOffload

    with pytest.raises(ConfigError, match="offload_dir") as err:
        OptimizerOffload.resolve(None, "optimizer_nvme", None)
    assert "--offload-dir" in str(err.value)
    assert OptimizerOffload.resolve(None, "optimizer_nvme", "/x").tier == "nvme"
    assert dataclasses.asdict(OptimizerOffload.resolve(None, "optimizer"))["tier"] == "host"


def test_the_plan_counts_the_device_parameters_the_executor_keeps_under_a_host_tier(tmp_path):
    """bf16 with the host tier: the executor keeps the device's float32 parameters (cast per step)
    and a second float32 copy, the masters, in host memory. The plan counts 4 B/param on the
    device and the masters in host memory, and its offload line says the masters are a copy."""
    from torch import nn

    from dtorch.cluster.load import cluster_from_dict
    from dtorch.model import profile_module
    from dtorch.plan.cost import DEFAULT_CONSTANTS, estimate
    from dtorch.plan.plan import Plan
    from dtorch.plan.strategies.memory import MEMORY

    fields = dict(microbatch_size=2, num_microbatches=2, param_dtype="bfloat16", offload="optimizer",
                  seq_len=SEQ, global_batch=BATCH)
    (run,) = run_group(1, [{"plan": fields}], _worker)[0]
    assert "error" not in run, run.get("error")
    assert run["tier"] == "host" and run["param_bytes"] == 4 * run["numel"]  # float32 on the device
    mem = run["memory"][0]
    assert mem["host_bytes"] - mem["buffer_bytes"] == 12 * run["numel"]  # masters (4) + moments (8)
    doc = _cluster_doc(2**40)
    doc["groups"][0]["device"]["peak_flops"]["bfloat16"] = 5e10
    cluster = cluster_from_dict(doc)
    est = estimate(Plan(**fields), profile_module(_factory, SEQ), cluster)
    # beside them, autocast's bf16 copy of every matmul weight (tests/plan/test_memory_categories.py)
    cast = sum(2 * m.weight.numel() for m in _factory().modules() if isinstance(m, nn.Linear))
    assert est.memory_breakdown["params"] == run["param_bytes"] + cast and est.memory_breakdown.get("optimizer", 0) == 0
    line = MEMORY.offload_summary(Plan(**fields), est, cluster.groups[0], DEFAULT_CONSTANTS)
    assert "a copy of the fp32 master weights in host memory (the device keeps its fp32 parameters" in line
