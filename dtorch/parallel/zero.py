"""ZeRO-1 and ZeRO-2 (`plan.zero`) with FSDP2's gradient-accumulation controls.

Parameters are sharded between steps (the float32 masters AdamW updates, 1/(dp_shard x cp) per
rank: the optimizer state is sharded with them) and replicated within a step: every FSDP unit
(block, and the root's rest) is built with ``reshard_after_forward=False`` and gathers once, at the
first micro-batch's forward; ``set_reshard_after_backward(False)`` keeps it gathered over the
micro-batches until the last backward reshards it. Gradients:

- ZeRO-1: ``set_requires_gradient_sync(False)`` on every micro-batch but the last, so full-size
  gradients accumulate locally (FSDP2 accumulates them in reduce_dtype) and each unit
  reduce-scatters once per step, after the last micro-batch;
- ZeRO-2: every micro-batch's backward reduce-scatters into the sharded gradients (accumulated
  there), so no full-size gradient outlives its unit's backward.

So ZeRO-1 issues one all-gather and one reduce-scatter per unit per step, whatever the micro-batch
count, which is what the planner prices (`dtorch.plan.strategies.zero`).

Without a pipeline `ParallelModel` calls `microbatch_controls` before each micro-batch. Under a
pipeline torch's stage drives the same controls itself (`PipelineStage.backward_maybe_with_nosync`
turns gradient sync and the reshard after backward off for every micro-batch's backward;
`perform_reduce_grad` reduces and reshards once after the last): that is ZeRO-1 as it is. For
ZeRO-2 the stage's root unit keeps gradient sync on (`_SyncEveryMicrobatch`), so each micro-batch
reduce-scatters while the parameters stay gathered; the final `perform_reduce_grad` then finds no
unsharded gradient left and only reshards (zero gradients of unused parameters are not reduced
then: with them a second, all-zero reduce-scatter would follow). Not under zero_bubble (a limit of
the planner half, refused before any process group): there a stage's weight backward runs after the
input backward that fires FSDP's post-backward hook, so each micro-batch's gradients stay full-size
until a later input backward reduces them, as many times as the schedule's order makes it.

Why FSDP2 and not `torch.distributed.optim.ZeroRedundancyOptimizer`: parameters stay DTensors, so
tensor parallelism composes as FSDP x TP does (2-D meshes), the pipeline schedule drives the
controls above, and `torch.distributed.checkpoint` saves and reshards the model and optimizer state
like FSDP's, and expert parallelism's own FSDP units (`dtorch.parallel.expert`) take the same
controls (ZeroRedundancyOptimizer takes plain tensors, all-reduces full gradients through DDP,
broadcasts parameters after its step and consolidates its state on one rank to save it).
"""

from __future__ import annotations

import dataclasses

from torch import nn
from torch.distributed.fsdp import FSDPModule

from dtorch.parallel.fsdp import apply_fsdp
from dtorch.parallel.halves import Half, Meshes
from dtorch.parallel.mesh import fsdp_mesh
from dtorch.plan.plan import Plan
from dtorch.plan.strategies.zero import zero_stage


def apply_zero(model: nn.Module, plan: Plan, meshes: Meshes) -> None:
    """FSDP2 units over the shard axis that stay gathered within a step (module doc)."""
    apply_fsdp(model, fsdp_mesh(meshes.mesh), dataclasses.replace(plan, reshard_after_forward=False),
               last_stage=meshes.last_stage)
    if zero_stage(plan) == 2 and plan.pp > 1:
        model.set_reduce_scatter_unused_params(False)  # type: ignore[union-attr]  (module doc)
        model.__class__ = type(f"ZeRO2{type(model).__name__}", (_SyncEveryMicrobatch, type(model)), {})


class _SyncEveryMicrobatch:
    """ZeRO-2 under a pipeline: the stage's root unit ignores torch's schedule turning gradient sync
    off for a micro-batch's backward, so every unit reduce-scatters each micro-batch."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        super().set_requires_gradient_sync(True, recurse=recurse)  # type: ignore[misc]


def microbatch_controls(model: FSDPModule, plan: Plan, last: bool) -> None:
    """Before each micro-batch of a step without a pipeline (`ParallelModel`): gathered from the first
    forward until the last backward; ZeRO-1 reduces after the last micro-batch only, ZeRO-2 after each."""
    model.set_reshard_after_backward(last)
    if zero_stage(plan) == 1:
        model.set_requires_gradient_sync(last)
        model.set_is_last_backward(last)


# ---- the executor half (dtorch.parallel.halves) ---------------------------------------------------
def _apply(part: nn.Module, meshes: Meshes, plan: Plan) -> None:
    # (FSDP's half stands aside; with EP the expert half builds the units, gathered all step too)
    if zero_stage(plan) and meshes.ep is None:
        apply_zero(part, plan, meshes)


HALVES = (Half(60, apply=_apply),)
"""At FSDP's order: after TP (10), CP (20), AC (40) and compile (50)."""
