"""`parallelize(model_or_factory, plan)`: apply a Plan with PyTorch's own distributed stack.

Order (torchtitan's): check -> mesh -> pipeline split -> every strategy's executor half in the
order of halves.py (tensor/sequence parallel -> context parallel hooks -> expert parallelism
(plan.ep) -> activation checkpointing -> torch.compile per block (plan.compile) -> FSDP2 / HSDP /
DDP) -> materialise from meta -> pipeline schedule. Everything up to materialisation runs
on the meta device, so no rank ever holds more than its shard: reference models initialise
rank-locally, pretrained weights are read slice by slice (`weights=`); see materialize.py for the
seed path of other modules.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtorch.errors import ConfigError
from dtorch.model.structure import find_structure, may_leave_parameters_unused
from dtorch.parallel.check import check_applies, check_plan, model_dims, model_facts
from dtorch.parallel.expert import expert_mesh
from dtorch.parallel.fsdp import classic_ddp, wrap_ddp
from dtorch.parallel.halves import Meshes, apply_all, check_all
from dtorch.parallel.hf import adapt
from dtorch.parallel.materialize import Startup, materialize, retie, tied_groups
from dtorch.parallel.mesh import build_mesh, default_device, ensure_process_group, sub_mesh
from dtorch.parallel.model import ParallelModel, local_microbatches, uneven_shares
from dtorch.parallel.pipeline import apply_pipeline_split, build_schedule, stage_layout
from dtorch.parallel.rng import seed_rank_streams
from dtorch.parallel.ties import stage_ties
from dtorch.plan.plan import Plan


def meta_model(model_or_factory: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    """The model on the meta device (a copy: the caller's module is never modified), transformers
    models seen through their reference-shaped adapter (see hf.py)."""
    if isinstance(model_or_factory, nn.Module):
        model = copy.deepcopy(model_or_factory)
        ties = tied_groups(model)
        model.to("meta")
        retie(model, ties)  # `.to` gives each module its own new Parameter
        return adapt(model)
    with torch.device("meta"):
        model = model_or_factory()
    if not isinstance(model, nn.Module):
        raise ConfigError("model", type(model).__name__, "the factory must return an nn.Module")
    return adapt(model)


def _token_sample(plan: Plan, seq_len: int | None) -> tuple:
    """What DTorch feeds a language model by default: token ids [microbatch_size, seq_len] (meta)."""
    return (torch.zeros(plan.microbatch_size, seq_len or 8, dtype=torch.long, device="meta"),)


def parallelize(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    plan: Plan,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device | str | None = None,
    seed: int = 0,
    seq_len: int | None = None,
    weights: Any = None,
    profile: Any = None,
    sample: tuple | None = None,
) -> ParallelModel:
    """Shard `model_or_factory` as `plan` says, on this process's rank; see ParallelModel.

    Inside a launched process (torchrun / `dtorch run`) the default process group is joined from
    the environment if needed; with no process group and a one-rank plan it runs single-process.
    `loss_fn(logits, labels)` returns the mean loss of one micro-batch (e.g.
    `dtorch.train.losses.next_token`). Initial weights equal those of the single-device model
    initialised with `seed`. Raises ConfigError before any process group exists if the plan cannot
    run this model (or `seq_len`, when given). `weights`: fill the parameters from a checkpoint
    instead (e.g. `dtorch.checkpoint.hf_weights.HFWeights`; see materialize.py); what start-up
    cost is in `ParallelModel.startup`. `profile`: the model's ModelProfile when the caller has it
    (the planner's facts: which strategies apply); else they are read off the meta model
    (`check.model_facts`). `sample`: one micro-batch of model inputs (a tuple) for the pipeline cut
    of a model that does not declare its stages; default token ids [microbatch_size, seq_len].
    """
    if isinstance(model_or_factory, nn.Module):
        model_or_factory = adapt(model_or_factory)
    model = meta_model(model_or_factory)
    # tied parameters (a head sharing the embedding's weight) stay one Parameter on every plan:
    # TP shards it once (tp.py), materialisation re-ties it, and when the pipeline puts its uses on
    # two stages their copies are kept in sync (ties.py)
    ties = tied_groups(model)
    structure = find_structure(model)  # once, on the whole model: carried to the monitor
    world = dist.get_world_size() if dist.is_initialized() else plan.world_size
    device = torch.device(device) if device is not None else default_device()
    sample = sample or _token_sample(plan, seq_len)
    layout, find_unused = _check(model, plan, profile, sample, seq_len, world, device)
    startup = Startup(model_or_factory, model, seed, weights)
    meshes = _meshes(plan, model, device, world)
    # Dropout's rule (rng.py): one stream per (pp, dp, cp) position, shared by the TP ranks.
    seed_rank_streams(plan, meshes.mesh, seed, device)
    pp_rank = sub_mesh(meshes.mesh, "pp").get_local_rank() if plan.pp > 1 else 0
    parts = apply_pipeline_split(model, plan, pp_rank, layout) if plan.pp > 1 else [(0, model)]
    for stage, part in parts:  # every strategy's executor half, in order (halves.py)
        meshes.last_stage = stage == plan.num_stages - 1
        apply_all(part, meshes, plan)
    _share_expert_loads(model, parts, meshes)
    init_device = torch.device("cpu") if plan.offload == "params" else device
    startup_stats = materialize([m for _, m in parts], startup, init_device)
    split_ties = stage_ties(model, ties, plan, parts, meshes.mesh, layout) if plan.pp > 1 and ties else None
    if split_ties is not None:
        split_ties.sync_weights()
    if classic_ddp(plan) and meshes.ep is None:  # (with EP, replicas are HSDP units: apply_fsdp_with_experts)
        parts = [(0, wrap_ddp(model, sub_mesh(meshes.mesh, "dp_replicate"), device, plan, find_unused=find_unused))]
    for _, part in parts:
        part.train()
    parallel = _parallel_model(plan, parts, meshes, loss_fn, device, structure)
    parallel.startup = startup_stats
    parallel.stage_ties = split_ties
    return parallel


def _check(model: nn.Module, plan: Plan, profile: Any, sample: tuple, seq_len: int | None, world: int,
           device: torch.device) -> tuple[Any, bool]:
    """Every check before any process group exists: the strategies that cannot apply to this model,
    the plan against the model and world, every executor half's own check. Returns the pipeline
    layout (pp > 1) and whether classic DDP looks for unused parameters."""
    # the planner's rule: a strategy that cannot apply to this model is refused with its reason
    check_applies(plan, profile if profile is not None else model_facts(model, plan, sample, seq_len))
    check_plan(plan, model_dims(model), seq_len=seq_len, world_size=world)
    layout = stage_layout(model, sample) if plan.pp > 1 else None
    # classic DDP walks the autograd graph for unused parameters only where one meta forward says a
    # step may leave some (a branch on values, a module that did not run): it costs a graph walk
    # per step, and torch warns on every rank when it finds none
    find_unused = classic_ddp(plan) and may_leave_parameters_unused(model, sample)
    check_all(model, plan, device.type)
    return layout, find_unused


def _meshes(plan: Plan, model: nn.Module, device: torch.device, world: int) -> Meshes:
    """The meshes of this rank (joining the default process group when needed)."""
    mesh = None
    if plan.world_size > 1 or dist.is_initialized():
        ensure_process_group(device)
        mesh = build_mesh(plan, device.type)
    return halves_meshes(plan, model, mesh, device.type, world)


def halves_meshes(plan: Plan, model: nn.Module, mesh: Any, device_type: str, world: int) -> Meshes:
    """What the executor halves apply `plan` with on this rank, around the world `mesh` (None
    single-process): expert parallelism's mesh, the tp mesh, whether the model has MoE blocks.
    `parallelize` and the dry run (`dtorch.parallel.dryrun`) build them the same way."""
    # expert parallelism borrows ep of the data-parallel ranks (dp_replicate x dp_shard x cp): the ([pp,] edp, ep[, tp]) mesh spans every rank, and its tp axis is
    # the one TP uses, so that FSDP finds the data- and tensor-parallel meshes under one root
    emesh = (expert_mesh(plan.ep, device_type, world, tp=plan.tp, pp=plan.pp, dp_replicate=plan.dp_replicate)
             if plan.ep > 1 else None)
    tp_mesh = (emesh["tp"] if emesh is not None else sub_mesh(mesh, "tp")) if plan.tp > 1 else None
    moe = any(hasattr(type(m), "dispatcher") for m in model.modules())
    return Meshes(mesh, emesh, tp_mesh, moe)


def _share_expert_loads(model: nn.Module, parts: list, meshes: Meshes) -> None:
    """The expert loads of the bias update: summed over the ranks that route different tokens (data
    and context parallel, per pipeline stage; EP installed its own over the same ranks)."""
    mesh = meshes.mesh
    if mesh is None or not hasattr(type(model), "load_all_reduce"):
        return
    axes = tuple(a for a in ("dp_replicate", "dp_shard", "cp") if a in (mesh.mesh_dim_names or ()))
    if axes and meshes.ep is None:
        group = (mesh[axes[0]] if len(axes) == 1 else mesh[axes]._flatten("moe_load")).get_group()
        for _, part in parts:
            part.load_all_reduce = partial(dist.all_reduce, group=group)


def _parallel_model(plan: Plan, parts: list, meshes: Meshes, loss_fn: Callable, device: torch.device,
                    structure: Any) -> ParallelModel:
    stage_ids = [s for s, _ in parts]
    dp_mesh = sub_mesh(meshes.mesh, "dp")
    dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0
    # uneven shares (dp_shares): this data-parallel rank's pipeline runs its own micro-batch count
    own = local_microbatches(plan, dp_rank) if uneven_shares(plan) else None
    schedule = build_schedule(parts, plan, sub_mesh(meshes.mesh, "pp"), device, loss_fn, own) if plan.pp > 1 else None
    return ParallelModel(
        plan, meshes.mesh, [m for _, m in parts], loss_fn, device,
        schedule=schedule,
        has_first_stage=0 in stage_ids,
        has_last_stage=plan.num_stages - 1 in stage_ids,
        loss_parallel=plan.tp > 1,
        context=meshes.context,
        dp_rank=dp_rank,
        dp_size=dp_mesh.size() if dp_mesh is not None else 1,
        structure=structure,
    )
