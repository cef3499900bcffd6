"""Data parallelism: FSDP2 per block then the root; HSDP over (dp_replicate, dp_shard); DDP.

Context-parallel ranks replicate the parameters, so FSDP/HSDP take the cp axis into their shard
axis (mesh.fsdp_mesh) and average gradients over it; a plan with cp > 1 always uses FSDP.

Every block is its own FSDP unit so that only one block's parameters are gathered at a time and
the all-gather of block i+1 overlaps the compute of block i; the root unit holds the embedding,
final norm and head. DDP (dp_replicate only) uses the FSDP-based `replicate`, which composes with
tensor parallelism and shares FSDP2's mixed-precision and hook machinery.

Precision, the same for every strategy: parameters are float32 master copies; the forward and
backward run in `plan.param_dtype`; data-parallel gradient reductions run in `plan.reduce_dtype`.
FSDP2 and `replicate` do both through their MixedPrecisionPolicy (parameters cast once per
all-gather, gradients reduced in reduce_dtype and accumulated into float32). Classic DDP and plans
without FSDP (single device, TP, PP) run under `torch.autocast(param_dtype)` (ParallelModel): the
matrix multiplications run in param_dtype while norms, softmax and the loss stay float32, the
weights are cast once per step (autocast's cache spans the micro-batches) and no second copy of
the model is kept. DDP's gradient buckets are reduced by `reduce_in_dtype` (a communication hook):
cast to reduce_dtype, all-reduce, divide by the group size, cast back.

Unused parameters: a data-dependent branch (a block that picks a branch by its input) leaves some
parameters without a gradient on one rank and not on another, and the ranks' reductions would then
differ in size (gloo aborts on the mismatch). Every FSDP2 / replicate unit therefore reduces a
zero gradient for a parameter it did not use (`set_reduce_scatter_unused_params`; free when every
parameter was used), and classic DDP runs with `find_unused_parameters=True`. A parameter no rank
used keeps grad None, as in one process (DDP does this itself; for FSDP2 / replicate
`UnusedParameters` tracks it). A unit must still run on every rank: a block that one rank skips
entirely is not supported.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from dtorch.model.structure import block_items, find_blocks
from dtorch.parallel.halves import Half, Meshes
from dtorch.parallel.mesh import fsdp_mesh, sub_mesh
from dtorch.plan.plan import Plan
from dtorch.plan.strategies.zero import zero_stage


def mp_policy(plan: Plan) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(
        param_dtype=getattr(torch, plan.param_dtype), reduce_dtype=getattr(torch, plan.reduce_dtype)
    )


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, plan: Plan, *, last_stage: bool) -> None:
    """Shard `model` (one pipeline stage or the whole model) over `dp_mesh`: 1-D for FSDP, 2-D
    (dp_replicate, dp_shard) for HSDP; with context parallelism the shard axis is dp_shard x cp
    (see mesh.fsdp_mesh)."""
    # Pinned host memory speeds up host-device copies; there is nothing to pin for without CUDA.
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if plan.offload == "params" else OffloadPolicy()
    )
    kw = dict(mesh=dp_mesh, mp_policy=mp_policy(plan), offload_policy=offload)
    _, blocks = find_blocks(model)
    items = block_items(blocks)
    for i, (_, block) in enumerate(items):
        # The last block's parameters are needed again at once by backward: keeping them saves an
        # all-gather. With pipelining, micro-batches re-enter every block, so follow the plan.
        reshard = plan.reshard_after_forward and not (last_stage and i == len(items) - 1 and plan.pp == 1)
        fully_shard(block, reshard_after_forward=reshard, **kw)
    fully_shard(model, reshard_after_forward=plan.reshard_after_forward and plan.pp > 1, **kw)
    model.set_reduce_scatter_unused_params(True)  # type: ignore[union-attr]  (unused parameters: module doc)


def uses_fsdp(plan: Plan) -> bool:
    """FSDP2 (or HSDP) holds the parameters: sharded data parallelism, or context parallelism."""
    return plan.dp_shard > 1 or plan.cp > 1


DDP_BUCKET_BYTES = 25 * 2**20


def classic_ddp(plan: Plan) -> bool:
    """Pure data parallelism (no TP, PP or sharding): PyTorch's DistributedDataParallel, whose C++
    reducer with gradient buckets measured 1.3x faster than the FSDP-based `replicate` on gloo."""
    return plan.dp_replicate > 1 and plan.dp_shard == 1 and plan.tp == 1 and plan.pp == 1 and plan.cp == 1


def reduce_in_dtype(state, bucket):
    """DDP communication hook: average the bucket over the group in `dtype` (reduce_dtype).
    `state`: (process group, dtype); `bucket`: a dist.GradBucket (DDP checks the annotation at
    registration, which postponed annotations would turn into a string, hence none here).

    The result is computed from the reduced buffer itself, not from the work's future value, so
    the hook also runs on backends whose futures carry no tensor (PyTorch's fake process group)."""
    group, dtype = state
    grads = bucket.buffer()
    buf = grads if grads.dtype == dtype else grads.to(dtype)
    buf.div_(group.size())
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()

    def done(_):
        if buf is not grads:
            grads.copy_(buf)
        return grads

    return fut.then(done)


def wrap_ddp(model: nn.Module, dp_mesh: DeviceMesh, device: torch.device, plan: Plan, *,
             find_unused: bool = True) -> nn.Module:
    """`model` (materialised, identical on every rank) under DistributedDataParallel, its gradients
    reduced in plan.reduce_dtype (the compute dtype comes from autocast, see the module doc)."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    group = dp_mesh.get_group()
    # forward_sync_buffers, not the deprecated broadcast_buffers (a FutureWarning on every rank);
    # with init_sync=False neither syncs at init, so the two are the same here.
    # find_unused (parallelize decides it: `may_leave_parameters_unused`): a data-dependent branch
    # leaves parameters without a gradient on some ranks; DDP then reduces zeros for them, and a
    # parameter no rank used keeps grad None as in one process. It costs a graph walk per forward.
    ddp = DistributedDataParallel(model, device_ids=ids, process_group=group,
                                  forward_sync_buffers=False, init_sync=False, find_unused_parameters=find_unused)
    ddp.register_comm_hook((group, getattr(torch, plan.reduce_dtype)), reduce_in_dtype)
    return ddp


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, plan: Plan) -> None:
    """Replicate `model` over `dp_mesh`. Blocks of at least DDP's bucket size (25 MiB) get their own
    all-reduce, issued as backward reaches them; smaller ones are reduced together with the root,
    as DDP's buckets would (one all-reduce per small block cost 45-58% of a step on gloo)."""
    _, blocks = find_blocks(model)
    for _, block in block_items(blocks):
        if sum(p.numel() * p.element_size() for p in block.parameters()) >= DDP_BUCKET_BYTES:
            replicate(block, mesh=dp_mesh, mp_policy=mp_policy(plan))
    replicate(model, mesh=dp_mesh, mp_policy=mp_policy(plan))
    model.set_reduce_scatter_unused_params(True)  # type: ignore[union-attr]  (unused parameters: module doc)


class UnusedParameters:
    """Which parameters of an FSDP2 / replicate model no data-parallel rank used in a step, so that
    their gradient is None as in one process (the zero gradient such units reduce for an unused
    parameter would otherwise let AdamW move it by its momentum and weight decay).

    A parameter counts as used in a step when the module that holds it ran a forward (a forward
    pre-hook per parameter-holding module: one flag write, whatever FSDP has gathered). Per step:
    `reset()` before the first micro-batch; `flags()` after backward, summed over the data-parallel
    ranks (it rides on the loss's all-reduce); `drop(summed)` sets grad None where no rank ran the
    parameter's module. A module that ran without its parameter reaching the loss keeps the (zero)
    gradient its unit reduced. Every rank must hold the same parameters (pp == 1)."""

    def __init__(self, model: nn.Module):
        # one slot per parameter (a tied one once: it is used when either of its modules runs)
        self.params: list[nn.Parameter] = []
        slot: dict[int, int] = {}
        per_module: dict[nn.Module, list[int]] = {}
        for mod in model.modules():
            for p in mod.parameters(recurse=False):
                if id(p) not in slot:
                    slot[id(p)] = len(self.params)
                    self.params.append(p)
                per_module.setdefault(mod, []).append(slot[id(p)])
        self.used = torch.zeros(len(self.params))
        for mod, slots in per_module.items():
            mod.register_forward_pre_hook(partial(self._ran, torch.tensor(slots)))

    def _ran(self, index: torch.Tensor, module: nn.Module, args: tuple) -> None:
        self.used.index_fill_(0, index, 1.0)  # (a pre-hook's return value would replace the args)

    def reset(self) -> None:
        self.used.zero_()

    def flags(self) -> torch.Tensor:
        return self.used

    def drop(self, summed: torch.Tensor) -> None:
        for i in (summed == 0).nonzero().flatten().tolist():
            self.params[i].grad = None


# ---- the executor half (dtorch.parallel.halves) ---------------------------------------------------
def _apply(part: nn.Module, meshes: Meshes, plan: Plan) -> None:
    if meshes.ep is not None:  # (with EP the expert half shards: apply_fsdp_with_experts)
        return
    if zero_stage(plan):  # ZeRO-1/2 build their own units (dtorch.parallel.zero)
        return
    if uses_fsdp(plan):
        apply_fsdp(part, fsdp_mesh(meshes.mesh), plan, last_stage=meshes.last_stage)
    elif plan.dp_replicate > 1 and not classic_ddp(plan):
        apply_ddp(part, sub_mesh(meshes.mesh, "dp_replicate"), plan)


HALVES = (Half(60, apply=_apply),)
"""FSDP2 / HSDP, or the FSDP-based replicate; classic DDP wraps the whole model after
materialisation (`wrap_ddp`, in `parallelize`)."""
