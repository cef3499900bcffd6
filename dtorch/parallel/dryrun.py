"""Dry run at full scale (`dtorch plan --verify`): apply a plan's sharding on a fake process group.

For representative ranks (the first rank of every pipeline rank's slice, i.e. every pipeline stage),
join PyTorch's fake process group at the plan's full world size, build the model on the meta
device, apply the pipeline split and every strategy's executor half in the order `parallelize`
runs them (`dtorch.parallel.halves`: tensor, context, expert parallelism, checkpointing, compile,
FSDP2 / HSDP), create gradients and AdamW moments, and count this rank's bytes from the real local
shard shapes. Nothing is allocated (meta tensors) and nothing is communicated (the fake group), so a 70B
model on 64 ranks takes seconds on a laptop. The planner's estimate is returned beside the
measurement: the estimate is checked, not trusted.

Model-state bytes measured: parameters and gradients (float32 master copies; FSDP2 keeps sharded
gradients in the parameter dtype, whatever reduce_dtype is), AdamW's two float32 moments (a step
counter per parameter is not counted). Activations are not measured here.

Start-up (`startup` per rank): the host bytes a rank holds while its weights are created, from
the same local shard shapes: rank-local initialisation = its parameters plus one generator
chunk (dtorch.models.init.CHUNK_ELEMENTS); loading a checkpoint = its parameters plus the largest
single block in flight (the slice read in the checkpoint dtype and its converted copy) - with the
parameters on a GPU only these transient parts are host memory; and the
bytes it reads from a checkpoint (its local elements in the checkpoint dtype: replicated tensors
are read by every replica). The Python/torch process itself (a few hundred MB) comes on top.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtorch.errors import ConfigError
from dtorch.parallel.check import check_executable, check_plan, model_dims
from dtorch.parallel.fsdp import uses_fsdp
from dtorch.parallel.halves import apply_all, check_all
from dtorch.parallel.mesh import build_mesh, sub_mesh
from dtorch.parallel.model import uneven_shares
from dtorch.parallel.parallelize import halves_meshes
from dtorch.parallel.pipeline import apply_pipeline_split, stage_ids
from dtorch.plan.plan import Plan


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _build_meta(model_spec: str, seq_len: int) -> nn.Module:
    from dtorch.models import build_model

    with torch.device("meta"):
        return build_model(model_spec, max_seq_len=seq_len)


def representative_ranks(plan: Plan) -> list[int]:
    """The first rank of every pipeline rank's slice of the mesh (pp is the outermost axis)."""
    per_pp = plan.world_size // plan.pp
    return [p * per_pp for p in range(plan.pp)]


def startup_bytes(params: list[torch.Tensor], checkpoint_dtype: str = "bfloat16") -> dict[str, int]:
    """Host bytes of one rank's start-up and the bytes it reads from a checkpoint (module docstring)."""
    from dtorch.models.init import CHUNK_ELEMENTS

    ck = torch.empty((), dtype=getattr(torch, checkpoint_dtype)).element_size()
    local = [_local(p) for p in params]
    param_bytes = sum(t.numel() * t.element_size() for t in local)
    largest = max((t.numel() for t in local), default=0)
    block = max((t.numel() * t.element_size() for t in local), default=0)
    chunk = CHUNK_ELEMENTS * (2 * 8 + 2 * 8 + 4)  # int64 indices/hash, float64 uniforms, float32 out
    return {
        # on CPU the parameters live in host memory; on a GPU only the transient part does
        "host_bytes_rank_local_init": param_bytes + chunk,
        "host_bytes_checkpoint_load": param_bytes + largest * ck + block,
        "transient_bytes_rank_local_init": chunk,
        "transient_bytes_checkpoint_load": largest * ck + block,
        "checkpoint_read_bytes": sum(t.numel() for t in local) * ck,
        "checkpoint_dtype_bytes": ck,
    }


def measure_rank(plan: Plan, model_spec: str, seq_len: int, rank: int,
                 checkpoint_dtype: str = "bfloat16") -> dict[str, Any]:
    """Model-state bytes of `rank` under `plan`, on a fake process group of the plan's world size."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    try:
        mesh = build_mesh(plan, "cpu", cache=False)
        model = _build_meta(model_spec, seq_len)
        meshes = halves_meshes(plan, model, mesh, "cpu", plan.world_size)
        pp_rank = sub_mesh(mesh, "pp").get_local_rank() if plan.pp > 1 else 0
        parts = apply_pipeline_split(model, plan, pp_rank) if plan.pp > 1 else [(0, model)]
        for stage, part in parts:  # every strategy's executor half, in parallelize's order (halves.py)
            meshes.last_stage = stage == plan.num_stages - 1
            apply_all(part, meshes, plan)
        # (classic DDP wraps the whole model after materialisation: its replicas hold every byte)
        params = [p for _, m in parts for p in m.parameters()]
        for p in params:
            p.grad = torch.zeros_like(p)
        # AdamW's two moments are zeros_like(param) (torch.optim.adam `_init_group`); creating them
        # directly measures the same shapes without the per-tensor cost of an optimizer step.
        moments = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params for _ in range(2)]
        out = {
            "rank": rank,
            "stages": stage_ids(plan, pp_rank) if plan.pp > 1 else [0],
            "params": 0 if plan.offload == "params" else _nbytes(params),
            "grads": 0 if plan.offload == "params" else _nbytes(p.grad for p in params),
            "optimizer": 0 if plan.offload in ("optimizer", "params") else _nbytes(moments),
            "num_params_local": sum(_local(p).numel() for p in params),
        }
        if uneven_shares(plan) and plan.pp == 1 and uses_fsdp(plan) and plan.offload != "params":
            # Uneven shares: FSDP keeps the parameters gathered and the gradients unsharded for the
            # whole step, so that every rank issues the same collectives (model.py, `_hold_unsharded`).
            param_b = torch.empty((), dtype=getattr(torch, plan.param_dtype)).element_size()
            full = out["num_params_local"] * plan.dp_shard * plan.cp * param_b
            out["grads_unsharded_accumulation"] = full
            out["params_unsharded_step"] = full
            out["grads"] += full
            out["params"] += full
        elif plan.pp > 1 and uses_fsdp(plan) and plan.num_microbatches > 1 and plan.offload != "params":
            # A pipeline stage under FSDP2 turns off gradient reduce-scatter until the last
            # micro-batch (torch.distributed.pipelining stage.py: set_requires_gradient_sync(False)),
            # so the stage holds unsharded gradients during the step, in reduce_dtype (FSDP2's
            # `to_accumulated_grad_if_needed`). They replace the sharded ones rather than add to them:
            # the last step's shards were set to None, and each unit's accumulation is freed as its
            # shard is made (measured with the real executor: tests/plan/test_zero_plan.py).
            red_b = torch.empty((), dtype=getattr(torch, plan.reduce_dtype)).element_size()
            out["grads_unsharded_accumulation"] = out["num_params_local"] * plan.dp_shard * plan.cp * red_b
            out["grads"] = out["grads_unsharded_accumulation"]
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        out["startup"] = startup_bytes(params, checkpoint_dtype)
        return out
    finally:
        dist.destroy_process_group()


def verify(plan: Plan, model_spec: str, seq_len: int, cluster: Any = None) -> dict[str, Any]:
    """Measure per-rank model-state bytes of `plan` at its full world size and compare them with
    the cost model's estimate for the fullest rank.

    Returns {"measured": {"ranks": [per representative rank: rank, stages, params, grads,
    optimizer, total (bytes)], "max": {...}}, "estimated": {params, grads, optimizer, total} or
    None, "relative_error": (estimated total - measured max total) / measured max total,
    "executable" / "not_executable_because": whether this executor can run the plan today,
    "seconds": wall time}. Context-parallel ranks shard parameters with the data-parallel ones
    (FSDP over dp_shard x cp, as the executor and the cost model do). `cluster` (optional) adds the full estimate (memory and time
    breakdowns). Raises ConfigError if the plan cannot run this model."""
    t0 = time.perf_counter()
    with torch.device("meta"):
        check_plan(plan, model_dims(_build_meta(model_spec, seq_len)), seq_len=seq_len, executable=False)
    try:
        check_executable(plan)
        with torch.device("meta"):  # every executor half's own check (the compiler itself is the target's)
            check_all(_build_meta(model_spec, seq_len), plan, None)
        not_executable = None
    except ConfigError as e:  # the sharding is measurable even where this executor cannot run it yet
        not_executable = str(e)
    if dist.is_initialized():
        raise RuntimeError("verify() runs on its own fake process group; call it outside a launched job")
    ranks = [measure_rank(plan, model_spec, seq_len, r) for r in representative_ranks(plan)]
    fullest = max(ranks, key=lambda r: r["total"])
    startup = {k: max(r["startup"][k] for r in ranks) for k in ranks[0]["startup"]}
    result: dict[str, Any] = {
        "startup_max": startup,
        "world_size": plan.world_size,
        "measured": {"ranks": ranks, "max": {k: fullest[k] for k in ("rank", "params", "grads", "optimizer", "total")}},
        "estimated": None,
        "relative_error": None,
        "executable": not_executable is None,
        "not_executable_because": not_executable,
    }
    try:
        from dtorch.plan import cost
        from dtorch.plan.profiles import get_profile

        profile = get_profile(model_spec, seq_len)
        est = cost.model_state_bytes(plan, profile)
        est["total"] = est["params"] + est["grads"] + est["optimizer"]
        result["estimated"] = est
        result["relative_error"] = (est["total"] - fullest["total"]) / fullest["total"]
        if cluster is not None:
            result["estimate"] = cost.estimate(plan, profile, cluster).to_dict()
    except ImportError:  # the planner's cost model is optional here
        pass
    result["seconds"] = time.perf_counter() - t0
    return result
