"""ParallelModel: what `parallelize` returns, and the contract the trainer builds on.

- `model_parts`: this rank's modules (one, or `virtual_stages` pipeline stages), already sharded;
  call them only through `forward_backward`.
- `dp_rank`, `dp_size`: this rank's data shard. Feed every step a local batch of
  `local_batch` samples (``[local_batch, seq]`` token ids and labels, or any nested tensors with
  the samples on dim 0: `forward_backward`): TP, CP and PP
  ranks of one data-parallel group get the SAME local batch (whole sequences: with context
  parallelism each rank keeps its own sequence shard of it). `local_batch` is
  ``plan.microbatch_size * num_local_microbatches``: `plan.num_microbatches`, or this data-parallel
  rank's entry of `plan.dp_shares` (uneven work on mixed devices, docs/heterogeneous.md).
- `forward_backward(inputs, labels) -> loss`: runs all micro-batches (the pipeline schedule when
  pp > 1, gradient accumulation when pp == 1), leaves in `.grad` the gradients of the mean loss
  over the GLOBAL batch (all data-parallel ranks, all micro-batches), and returns that mean loss
  as a float32 0-d CPU tensor, identical on every rank. It is one all-reduce over the world.
- `parameters()`: this rank's parameters (DTensors when sharded); give them to the optimizer.
- `clip_grad_norm_(max_norm, norm_type=2.0) -> total_norm`: the norm of the whole model's
  gradient (across shards, replicas and pipeline stages), identical on every rank; scales in place.
- `state_dict_for_checkpoint()`: {fully qualified name of the unsplit model: tensor or DTensor},
  the same keys whatever the plan; pass it to `torch.distributed.checkpoint.save/load`, which
  reshards on load. Optimizer state: `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict
  (part, optim)` per part.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard, _StridedShard
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map_only

from dtorch.model.outputs import batch_size, call_model, logits_of
from dtorch.model.structure import ModelStructure, blocks_of
from dtorch.parallel.cp import ContextParallel
from dtorch.parallel.fsdp import UnusedParameters, uses_fsdp
from dtorch.parallel.zero import microbatch_controls
from dtorch.plan.plan import Plan
from dtorch.plan.strategies.zero import zero_stage


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _to(batch: Any, device: torch.device) -> Any:
    """Every tensor of a nested batch moved to `device` (None stays None)."""
    return tree_map_only(torch.Tensor, lambda t: t.to(device), batch)


def _chunks(batch: Any, n: int) -> list[Any]:
    """`n` micro-batches of a nested batch: dim 0 of every tensor chunked alike (as torch.chunk:
    fewer when the batch has fewer samples). None gives n Nones."""
    if batch is None:
        return [None] * n
    size = batch_size(batch)
    count = len(range(0, size, math.ceil(size / n))) if size else 1
    return [tree_map_only(torch.Tensor, lambda t, i=i: t.chunk(n)[i] if t.dim() else t, batch) for i in range(count)]


def uneven_shares(plan: Plan) -> bool:
    """The plan gives its data-parallel ranks different numbers of micro-batches per step."""
    return plan.dp_shares is not None and len(set(plan.dp_shares)) > 1


def local_microbatches(plan: Plan, dp_rank: int) -> int:
    """Micro-batches per step of data-parallel rank `dp_rank`: its `dp_shares` entry, else
    `num_microbatches` (then every rank runs the same number)."""
    return int(plan.dp_shares[dp_rank]) if uneven_shares(plan) else plan.num_microbatches


class ParallelModel:
    def __init__(
        self,
        plan: Plan,
        mesh: DeviceMesh | None,
        model_parts: list[nn.Module],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        *,
        schedule=None,
        has_first_stage: bool = True,
        has_last_stage: bool = True,
        loss_parallel: bool = False,
        context: ContextParallel | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        structure: ModelStructure | None = None,
    ):
        self.plan = plan
        self.structure = structure
        """Where the model's blocks, embeddings and head are (`dtorch.model.structure`), found once
        on the whole model before it was split or wrapped."""
        self.mesh = mesh
        self.model_parts = model_parts
        self.loss_fn = loss_fn
        self.device = device
        self.schedule = schedule
        self.has_first_stage = has_first_stage
        self.has_last_stage = has_last_stage
        self.loss_parallel = loss_parallel
        self.context = context
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.distributed = mesh is not None and dist.is_initialized()
        # (not with per-block torch.compile: its hooks would run inside the compiled graphs)
        self.unused = (UnusedParameters(model_parts[0]) if self.distributed and plan.pp == 1
                       and isinstance(model_parts[0], FSDPModule) and not getattr(plan, "compile", False) else None)
        """Under FSDP2 / replicate: parameters no rank used in a step get grad None (fsdp.py)."""
        self.stage_ties = None
        """Parameters tied across pipeline stages (`dtorch.parallel.ties.StageTies`), or None."""
        self.uneven = uneven_shares(plan)
        self.num_local_microbatches = local_microbatches(plan, dp_rank)
        """Micro-batches this rank runs per step (its `dp_shares` entry, or `num_microbatches`)."""
        self.local_batch = plan.microbatch_size * self.num_local_microbatches
        """Samples this rank takes per step (its contiguous slice of the global batch)."""
        if (schedule is None or self.uneven) and plan.num_microbatches > 1:
            # each micro-batch's loss is divided by m (the mean share): so must the MoE balance loss's
            # injected gradient be (under PP with even shares the schedule's scale_grads divides all
            # gradients alike; with uneven shares the schedule's loss is divided instead, see pipeline.py)
            for part in model_parts:
                for m in part.modules():
                    if hasattr(type(m), "aux_grad_scale"):
                        m.aux_grad_scale = 1.0 / plan.num_microbatches

    def set_dp_shares(self, shares: list[int] | None) -> None:
        """Change the data-parallel shares between two steps (the straggler response re-plans with
        measured speeds, docs/monitoring.md): the same global batch, cut by `shares`. Every rank
        must call it with the same shares. Pipeline plans keep theirs: their schedules are built
        for one micro-batch count (ConfigError)."""
        import dataclasses

        from dtorch.errors import ConfigError

        if self.schedule is not None:
            raise ConfigError("dp_shares", shares, "a pipeline's shares are set when it is built; restart the job "
                              "with the new plan (the checkpoint resumes under it)")
        plan = dataclasses.replace(self.plan, dp_shares=list(shares) if shares is not None else None)
        plan.validate()
        from dtorch.plan.strategies.batch import BATCH

        for limit in BATCH.limits(plan):
            raise limit.error()
        self.plan = plan
        self.uneven = uneven_shares(plan)
        self.num_local_microbatches = local_microbatches(plan, self.dp_rank)
        self.local_batch = plan.microbatch_size * self.num_local_microbatches

    def blocks(self) -> list[nn.Module]:
        """This rank's blocks, over all its model parts (what the monitor times per block)."""
        return blocks_of(self.model_parts, self.structure)

    # ---- step ----------------------------------------------------------------------------------
    def _compute_context(self):
        stack = contextlib.ExitStack()
        if self.loss_parallel:
            stack.enter_context(loss_parallel())
        if self.plan.param_dtype != "float32" and not uses_fsdp(self.plan) and (
            self.plan.dp_replicate == 1 or isinstance(self.model_parts[0], DistributedDataParallel)
        ):
            # No FSDP (or FSDP-based replicate) to cast parameters: autocast gives the same compute dtype.
            stack.enter_context(torch.autocast(self.device.type, dtype=getattr(torch, self.plan.param_dtype)))
        return stack

    def forward_backward(self, inputs: Any, labels: Any) -> torch.Tensor:
        """`inputs`: this rank's local batch of model input, a tensor or a tuple / list / dict of
        tensors (positional / keyword arguments, `dtorch.model.outputs.call_model`), each with the
        samples on dim 0; `labels`: the target in the same form, or None. Each micro-batch is the
        matching slice of dim 0 of every tensor; the loss is `loss_fn(logits_of(output), target)`.
        Pipeline and context parallelism take token tensors only."""
        samples = batch_size(inputs)
        if self.uneven and samples != self.local_batch:
            from dtorch.errors import ConfigError

            raise ConfigError("local batch", f"{samples} samples on data-parallel rank {self.dp_rank}",
                              f"this rank runs {self.num_local_microbatches} micro-batches of "
                              f"{self.plan.microbatch_size}: feed ParallelModel.local_batch = {self.local_batch} "
                              "samples (GlobalSampler.local_indices with the plan's shares)")
        if (self.schedule is not None or self.context is not None) and not (
                isinstance(inputs, torch.Tensor) and isinstance(labels, torch.Tensor)):
            from dtorch.errors import ConfigError

            raise ConfigError("plan", "pp > 1" if self.schedule is not None else "cp > 1",
                              f"pipeline and context parallelism take one tensor of token ids, not a "
                              f"{type(inputs).__name__} input; use a plan with pp=1 and cp=1")
        inputs, labels = _to(inputs, self.device), _to(labels, self.device)
        if self.unused is not None:
            self.unused.reset()
        if self.context is not None:
            inputs, labels = self.context.shard(inputs), self.context.shard(labels)
        with self._compute_context():
            if self.schedule is not None:
                local = self._pipeline_step(inputs, labels)
                if self.stage_ties is not None:
                    self.stage_ties.sync_grads()
            else:
                local = self._accumulate(inputs, labels)
        self._reduce_partial_grads()
        return self._global_mean(local)

    @torch.no_grad()
    def _reduce_partial_grads(self) -> None:
        """Sequence-parallel norm weights get Partial (unreduced) DTensor gradients. Reduce them
        once here; otherwise every optimizer op would all-reduce them again, and a norm over
        local values would be wrong."""
        for p in self.parameters():
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                p.grad = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])

    def _accumulate(self, inputs: Any, labels: Any) -> torch.Tensor:
        (model,) = self.model_parts
        n = self.num_local_microbatches
        # Every micro-batch's mean loss is divided by the MEAN share m = num_microbatches: after the
        # data-parallel average (/ dp) each weighs 1 / (dp * m) = 1 / (all micro-batches of the global
        # batch), whichever rank ran it, so uneven shares give the gradient of the global-batch mean.
        m = self.plan.num_microbatches
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(zip(_chunks(inputs, n), _chunks(labels, n))):
            last = i == n - 1
            # FSDP2 reduce-scatters every micro-batch's gradients into the sharded ones (as torchtitan
            # does): deferring it to the last would hold a full unsharded gradient copy per rank
            sync = contextlib.nullcontext()
            if isinstance(model, DistributedDataParallel) and not last:
                sync = model.no_sync()  # likewise for DDP
            elif zero_stage(self.plan) and isinstance(model, FSDPModule):
                microbatch_controls(model, self.plan, last)  # ZeRO-1/2: gathered all step (zero.py)
            elif self.uneven and isinstance(model, FSDPModule):
                self._hold_unsharded(model, last)
            with sync:
                loss = self.loss_fn(logits_of(call_model(model, x)), y) / m
                loss.backward()
            total += _local(loss.detach()).float()
        return total

    def _hold_unsharded(self, model: FSDPModule, last: bool) -> None:
        """Uneven shares under FSDP2 / replicate: ranks with different micro-batch counts must still
        issue the same collectives. Parameters are gathered once, at a rank's first forward, and
        stay gathered (the plan has reshard_after_forward=false: a Limit of the batch strategy;
        no reshard after backward but the last); gradients are reduced once, after its last
        micro-batch. So every rank all-gathers and reduces exactly once per step, holding
        unsharded parameters and gradients during the step (DDP's memory), as a pipeline stage
        under FSDP does for its gradients. (Under PP the schedule defers the reduction and the
        reshard after backward to the end of the step itself: `perform_reduce_grad`.)"""
        model.set_requires_gradient_sync(last)
        if uses_fsdp(self.plan):
            model.set_reshard_after_backward(last)
            model.set_is_last_backward(last)

    @torch.no_grad()
    def eval_local_loss(self, inputs: Any, labels: Any) -> torch.Tensor:
        """This rank's share of one evaluation batch's loss, forward only (the model parts in eval
        mode are the caller's): its micro-batches' mean losses over the plan's mean micro-batch
        count, weighed as `train_step` weighs them; the caller reduces it as `train_step` does.
        A pipeline runs its schedule's forward-only `eval`."""
        inputs, labels = _to(inputs, self.device), _to(labels, self.device)
        if self.context is not None:
            inputs, labels = self.context.shard(inputs), self.context.shard(labels)
        with self._compute_context():
            if self.schedule is not None:
                return self._pipeline_step(inputs, labels, forward_only=True)
            (model,) = self.model_parts
            n, m = self.num_local_microbatches, self.plan.num_microbatches
            total = torch.zeros((), device=self.device)
            for x, y in zip(_chunks(inputs, n), _chunks(labels, n)):
                total += _local(self.loss_fn(logits_of(call_model(model, x)), y).detach()).float() / m
            return total

    def _pipeline_step(self, inputs: torch.Tensor, labels: torch.Tensor, forward_only: bool = False) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        target = labels if self.has_last_stage else None
        run = self.schedule.eval if forward_only else self.schedule.step
        # return_outputs=False: only the losses are used; else the last stage keeps every
        # micro-batch's logits until the step ends (torch's `output_chunks`, merged for the return)
        if self.has_first_stage:
            run(inputs, target=target, losses=losses, return_outputs=False)
        else:
            run(target=target, losses=losses, return_outputs=False)
        if not self.has_last_stage:
            return torch.zeros((), device=self.device)
        stacked = torch.stack([_local(x.detach()).float() for x in losses])
        # uneven shares: the schedule's losses are already divided by the mean share (pipeline.py)
        return stacked.sum() if self.uneven else stacked.mean()

    def _global_mean(self, local: torch.Tensor) -> torch.Tensor:
        """Mean over data-parallel and context-parallel ranks (each holds the mean over its tokens)
        of the last pipeline stage's loss; TP replicas hold the same value and the other stages
        contribute zero."""
        if not self.distributed:
            return local.detach().cpu()
        buf = local.detach().clone()
        if self.unused is not None:  # the unused-parameter flags ride on this all-reduce
            buf = torch.cat([buf.reshape(1), self.unused.flags().to(buf.device, buf.dtype)])
        dist.all_reduce(buf)
        if self.unused is not None:
            self.unused.drop(buf[1:].cpu())
            buf = buf[0]
        return (buf / (dist.get_world_size() // self.plan.pp)).cpu()

    @torch.no_grad()
    def update_expert_bias(self) -> bool:
        """After an optimizer step: the auxiliary-loss-free expert bias update of a MoE model
        (`dtorch.models.moe.MoETransformer.update_expert_bias`, on every pipeline stage this rank
        holds; loads summed over the ranks that route different tokens, installed by `parallelize`).
        True if the model has such a bias (False: nothing to do)."""
        found = False
        for part in self.model_parts:
            part = getattr(part, "module", part)  # a DDP wrapper
            if getattr(getattr(part, "config", None), "bias_update_speed", 0) > 0 and hasattr(part, "update_expert_bias"):
                part.update_expert_bias()
                found = True
        return found

    # ---- parameters ----------------------------------------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        for part in self.model_parts:
            yield from part.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        from dtorch.parallel.materialize import clean_name

        for part in self.model_parts:
            for name, p in part.named_parameters():
                yield clean_name(name), p

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        # a parameter tied across pipeline stages counts once (its copies hold the same gradient)
        copies = self.stage_ties.copies if self.stage_ties is not None else set()
        total = self._grad_norm([p.grad for p in self.parameters() if p.grad is not None and id(p) not in copies],
                                float(norm_type))
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            _local(g).mul_(coef.to(_local(g).device, _local(g).dtype))
        return total

    def _grad_norm(self, grads: list[torch.Tensor], p: float) -> torch.Tensor:
        """One all-reduce over the world: each rank adds its local |g|^p, weighted by
        (distinct shards / ranks holding this stage) so every element counts exactly once."""
        holders = dist.get_world_size() // self.plan.pp if self.distributed else 1
        acc = torch.zeros((), device=self.device, dtype=torch.float64)
        for g in grads:
            local = _local(g).detach()
            if math.isinf(p):
                acc = torch.maximum(acc, local.abs().max().double())
                continue
            shards = 1
            if isinstance(g, DTensor):
                for size, pl in zip(g.device_mesh.shape, g.placements):
                    if isinstance(pl, Shard | _StridedShard):
                        shards *= size
            acc += local.double().abs().pow(p).sum() * (shards / holders)
        if self.distributed:
            dist.all_reduce(acc, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM)
        return (acc if math.isinf(p) else acc.pow(1.0 / p)).float()

    # ---- checkpoint ----------------------------------------------------------------------------
    def state_dict_for_checkpoint(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from dtorch.parallel.materialize import clean_name

        state: dict[str, torch.Tensor] = {}
        for part in self.model_parts:
            # (one process: torch.compile's `_orig_mod.` is in a plain state_dict's keys; take it out)
            state.update(get_model_state_dict(part) if self.distributed
                         else {clean_name(k): v for k, v in part.state_dict().items()})
        return state
