"""Parameters tied across pipeline stages: Megatron's embedding group, for any tie.

A head that shares the token embedding's weight (`lm_head.weight = wte.weight`) is one Parameter
on one process, and stays one under DDP, FSDP and TP (materialize.retie, tp.py). A pipeline puts
its two uses on two stages, each of which holds a copy. `StageTies` keeps the copies one
parameter: they start equal (`sync_weights`, once after materialisation) and, after every step's
backward, each copy's gradient is replaced by the sum over all copies (`sync_grads`), which is the
tied parameter's gradient (both uses); with equal gradients and equal optimizer states the copies
take the same optimizer step and stay equal. Checkpoints hold each copy under its own name, with
the same values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtorch.parallel.materialize import clean_name
from dtorch.parallel.pipeline import split_stage
from dtorch.plan.plan import Plan


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class StageTies:
    """This rank's copies of the parameters tied across pipeline stages.

    Contract: call `sync_weights()` once after the parts are materialised and `sync_grads()` after
    every step's backward, before clipping and the optimizer, on every rank (they are collectives
    over the ranks holding a tie). Copies on different ranks must be sharded alike (the same data-
    and tensor-parallel placements: an embedding and a head both shard the vocabulary dimension; a
    gradient is laid out as its parameter first).
    """

    def __init__(self, groups: list[tuple[list[nn.Parameter], object, int]], copies: set[int]):
        self.groups = groups
        """Per tied parameter: (this rank's copies, the process group over the ranks holding the
        tie or None if this rank holds them all, the global rank of the first holding stage)."""
        self.copies = copies
        """ids of this rank's parameters that repeat a tied parameter whose first holding stage is
        another: a gradient norm leaves them out so that the tied parameter counts once."""

    @torch.no_grad()
    def sync_weights(self) -> None:
        for params, group, src in self.groups:
            if group is not None:
                dist.broadcast(_local(params[0]), src=src, group=group)
            for p in params[1:]:
                _local(p).copy_(_local(params[0]))

    @torch.no_grad()
    def sync_grads(self) -> None:
        for params, group, _ in self.groups:
            for p in params:
                if p.grad is None:  # a stage that did not use its copy this step contributes zeros
                    p.grad = torch.zeros_like(p)
                elif hasattr(p.grad, "placements") and p.grad.placements != p.placements:
                    # a row-wise (vocabulary-sharded) embedding's gradient comes back replicated:
                    # laid out as its parameter (a local slice), every copy's local block matches
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            grads = [_local(p.grad) for p in params]
            total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
            if group is not None:
                dist.all_reduce(total, group=group)
            for g in grads:
                if g is not total:
                    g.copy_(total)


def stage_ties(model: nn.Module, groups: list[list[str]], plan: Plan, parts: list[tuple[int, nn.Module]],
               mesh: DeviceMesh, layout=None) -> StageTies | None:
    """The ties (`materialize.tied_groups` of the whole meta `model`) that the pipeline split puts on
    more than one stage, for this rank's materialised `parts`; None if there are none. Every rank
    calls it (it creates one process group per tie and column of the mesh's "pp" axis). `layout`:
    the split layout `parts` were made with (`pipeline.split_stage`)."""
    stages = [split_stage(model, plan, s, *([layout] if layout is not None else [])) for s in range(plan.num_stages)]
    split = []
    for names in groups:
        holders = [s for s, stage in enumerate(stages) if _holds(stage, names)]
        if len(holders) > 1:
            split.append((names, holders))
    if not split:
        return None
    axes = list(mesh.mesh_dim_names)
    # every line of ranks along "pp" (the same data-, tensor- and context-parallel position)
    columns = mesh.mesh.movedim(axes.index("pp"), -1).reshape(-1, plan.pp).tolist()
    me = dist.get_rank()
    out, copies = [], set()
    for names, holders in split:
        pp_ranks = sorted({s % plan.pp for s in holders})
        group, src = None, -1
        for column in columns:
            ranks = [column[r] for r in pp_ranks]
            if len(ranks) == plan.pp:  # every pipeline rank holds a copy: the mesh's own pp group
                g = mesh["pp"].get_group()
            else:  # collective: every rank creates every column's group, in the same order
                g = dist.new_group(ranks) if len(ranks) > 1 else None
            if me in column:
                group, src = g, column[holders[0] % plan.pp]
        params = []
        for stage, part in parts:
            if stage not in holders:
                continue
            own = {clean_name(n): p for n, p in part.named_parameters(remove_duplicate=False)}
            p = next(own[n] for n in names if n in own)
            params.append(p)
            if stage != holders[0]:
                copies.add(id(p))
        if params:
            out.append((params, group, src))
    return StageTies(out, copies)


def _holds(stage: nn.Module, names: list[str]) -> bool:
    return any(clean_name(n) in names for n, _ in stage.named_parameters(remove_duplicate=False))
