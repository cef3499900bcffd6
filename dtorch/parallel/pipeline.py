"""Pipeline split on block boundaries and the `torch.distributed.pipelining` schedule.

Each pipeline rank holds `virtual_stages` stages. A stage is a copy of the (meta) model with the
blocks of other stages deleted and the embedding (first stage) or final norm and head (last stage)
set to None, so the model's own forward runs unchanged and parameter names (FQNs) stay those of the
whole model: checkpoints do not depend on the pipeline layout.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    _PipelineSchedule,
)

from dtorch.model.structure import block_items, find_blocks
from dtorch.plan.plan import Plan

FIRST_STAGE_ONLY = ("tok_embeddings", "pos_embeddings", "wte", "wpe", "embed_tokens")
LAST_STAGE_ONLY = ("norm", "output", "ln_f", "lm_head")


def layer_partition(plan: Plan, num_layers: int) -> list[int]:
    """Blocks per stage: the plan's partition, or as even as possible (earlier stages get the extra
    block, so the last stage, which also carries the output head and the loss, is never the larger)."""
    if plan.layer_partition is not None:
        return list(plan.layer_partition)
    base, extra = divmod(num_layers, plan.num_stages)
    return [base + (1 if s < extra else 0) for s in range(plan.num_stages)]


def stage_ids(plan: Plan, pp_rank: int) -> list[int]:
    """Stages this pipeline rank runs: looped placement r, r+pp, r+2pp, ... (interleaved schedules)."""
    return [pp_rank + k * plan.pp for k in range(plan.virtual_stages)]


def split_stage(model: nn.Module, plan: Plan, stage: int) -> nn.Module:
    """A copy of `model` (on meta: free) that keeps only the blocks of `stage`."""
    part = copy.deepcopy(model)
    _, blocks = find_blocks(part)
    sizes = layer_partition(plan, len(blocks))
    start = sum(sizes[:stage])
    keep = {name for name, _ in block_items(blocks)[start:start + sizes[stage]]}
    assert isinstance(blocks, nn.ModuleDict), "pipeline split needs blocks in an nn.ModuleDict (stable names)"
    for name in [n for n, _ in block_items(blocks) if n not in keep]:
        del blocks[name]
    # Reference models declare their first/last-stage modules; otherwise the usual names.
    first_only = getattr(part, "input_modules", FIRST_STAGE_ONLY)
    last_only = getattr(part, "output_modules", LAST_STAGE_ONLY)
    for attr in first_only if stage > 0 else ():
        if hasattr(part, attr):
            setattr(part, attr, None)
    for attr in last_only if stage < plan.num_stages - 1 else ():
        if hasattr(part, attr):
            setattr(part, attr, None)
    return part


def apply_pipeline_split(model: nn.Module, plan: Plan, pp_rank: int) -> list[tuple[int, nn.Module]]:
    """(stage id, module) for every stage this rank runs."""
    return [(s, split_stage(model, plan, s)) for s in stage_ids(plan, pp_rank)]


def build_schedule(
    parts: list[tuple[int, nn.Module]],
    plan: Plan,
    pp_mesh: DeviceMesh,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    num_microbatches: int | None = None,
) -> _PipelineSchedule:
    """The schedule over this rank's stages. Stage shapes are inferred at the first step.

    `loss_fn` returns the mean loss of one micro-batch; the schedule's `scale_grads` divides the
    accumulated gradients by the number of micro-batches, so they equal those of the batch mean.
    `num_microbatches`: this data-parallel rank's count when it differs from the plan's mean
    (`dp_shares`): then the loss is divided by the mean share instead and the gradients are not
    scaled, so after the data-parallel average every micro-batch of the global batch weighs alike.
    """
    group = pp_mesh.get_group()
    stages = [PipelineStage(m, s, plan.num_stages, device, group=group) for s, m in parts]
    n = plan.num_microbatches if num_microbatches is None else int(num_microbatches)
    kw: dict = dict(loss_fn=loss_fn)
    if num_microbatches is not None:
        mean = plan.num_microbatches
        kw = dict(loss_fn=lambda out, target: loss_fn(out, target) / mean, scale_grads=False)
    if plan.schedule == "gpipe":
        return ScheduleGPipe(stages[0], n, **kw)
    if plan.schedule == "1f1b":
        return Schedule1F1B(stages[0], n, **kw)
    if plan.schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n, **kw)
    assert plan.schedule == "zero_bubble", plan.schedule
    return ScheduleInterleavedZeroBubble(stages, n, **kw)
