"""Pipeline split on block boundaries and the `torch.distributed.pipelining` schedule.

Each pipeline rank holds `virtual_stages` stages. A stage is a copy of the (meta) model that keeps
only its own blocks and runs the model's own forward, so parameter names (FQNs) stay those of the
whole model: checkpoints do not depend on the pipeline layout, and TP, AC and FSDP find the blocks
where they are in the whole model. Two ways, by what the model declares:

- **declared** (DTorch's reference models and transformers adapters: `input_modules` /
  `output_modules`, blocks in an nn.ModuleDict): the blocks of other stages are deleted and the
  embedding (first stage) or final norm and head (last stage) set to None; the forward is written
  to skip what is None.
- **any other model whose blocks run in sequence** (`dtorch.model.split` checks that, and which
  stage holds each parameter outside the blocks, on one meta forward): blocks of other stages are
  replaced by parameter-free stand-ins (the container keeps its indices, so an nn.ModuleList or
  nn.Sequential works as well), and so are the modules outside the blocks whose parameters another
  stage holds. A stage returns (its last block's output, the model's inputs) to the next one,
  which runs the forward again from those inputs: the parameter-free code around the blocks
  (positions, masks, rotary tables) recomputes the same values, what another stage's modules
  would have produced is zeros of the right shape and reaches nothing that counts (the split
  check proves it), the stand-in before the stage's first block hands it the activation received,
  and the stand-in after its last block ends the forward.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

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
from torch.utils._pytree import tree_map

from dtorch.model.outputs import logits_of
from dtorch.model.split import SplitLayout, declares_stages, split_layout, submodule
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


def split_stage(model: nn.Module, plan: Plan, stage: int, layout: SplitLayout | None = None) -> nn.Module:
    """A copy of `model` (on meta: free) that keeps only the blocks of `stage`: the declared way for
    models that declare their stage modules, else the general way with `layout` (from
    `dtorch.model.split.split_layout`; required then)."""
    if layout is None:
        return _declared_stage(model, plan, stage)
    return _general_stage(model, plan, stage, layout)


def _declared_stage(model: nn.Module, plan: Plan, stage: int) -> nn.Module:
    part = copy.deepcopy(model)
    _, blocks = find_blocks(part)
    sizes = layer_partition(plan, len(blocks))
    start = sum(sizes[:stage])
    keep = {name for name, _ in block_items(blocks)[start:start + sizes[stage]]}
    assert isinstance(blocks, nn.ModuleDict), "the declared pipeline split needs blocks in an nn.ModuleDict"
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


class _StageEnd(Exception):
    """Raised by the stand-in after a stage's last block: carries that block's output."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


class _Skipped(nn.Module):
    """Stands in for a block another stage holds. `role`: 'pass' (a block before this stage: hands
    its input on, the value is discarded later), 'enter' (the block just before this stage: hands
    on the activation this stage received) or 'end' (the first block after this stage: ends the
    forward with its input, the stage's output)."""

    def __init__(self, role: str, arity: int):
        super().__init__()
        self.role, self.arity = role, arity
        self.received: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x = args[0] if args else next(iter(kwargs.values()))
        if self.role == "end":
            raise _StageEnd(x)
        out = self.received if self.role == "enter" else x
        # a tuple as the block returns it: its other elements are read by nothing (`split_layout`)
        return (out, *(None,) * (self.arity - 1)) if self.arity else out


class _Elsewhere(nn.Module):
    """Stands in for a module outside the blocks whose parameters another stage holds: returns
    zeros shaped like the module's output (its meta copy runs on meta inputs). The split check
    proves these zeros reach nothing that counts."""

    def __init__(self, module: nn.Module):
        super().__init__()
        object.__setattr__(self, "_meta", copy.deepcopy(module).to("meta"))  # not a submodule: no parameters

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        device = next((t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        out = self._meta(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
        return tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device)
                        if isinstance(t, torch.Tensor) else t, out)


def _to_meta(t: Any) -> Any:
    return t.to("meta") if isinstance(t, torch.Tensor) else t


def _general_stage(model: nn.Module, plan: Plan, stage: int, layout: SplitLayout) -> nn.Module:
    part = copy.deepcopy(model)
    container = submodule(part, layout.block_path)
    items = block_items(container)
    sizes = layer_partition(plan, len(items))
    start, stop = sum(sizes[:stage]), sum(sizes[:stage + 1])
    first, last = stage == 0, stage == plan.num_stages - 1
    enter: _Skipped | None = None
    for i, (name, _) in enumerate(items):
        if start <= i < stop:
            continue
        role = "end" if i == stop else "enter" if i == start - 1 else "pass"
        stand_in = _Skipped(role, layout.block_output_arity)
        if role == "enter":
            enter = stand_in
        if isinstance(container, nn.ModuleDict):
            container[name] = stand_in
        else:
            container[int(name)] = stand_in
    elsewhere = set(layout.first if not first else ()) | set(layout.last if not last else ())
    _drop_parameters(part, elsewhere, layout)
    forward = part.forward

    def stage_forward(*args: Any) -> Any:
        inputs = args
        if enter is not None:
            enter.received, inputs = args[0], args[1:]
        try:
            out = forward(*inputs)
        except _StageEnd as end:
            # the model's inputs travel on: the next stage runs the forward from them again (sent
            # contiguous: the receiving stage allocates its buffers from the sent tensors' layout)
            return (end.hidden.contiguous(),
                    *(t.detach().contiguous() if isinstance(t, torch.Tensor) else t for t in inputs))
        finally:
            if enter is not None:
                enter.received = None
        assert last, "a stage before the last ran past its last block"
        return logits_of(out)  # what the loss reads (a transformers model returns a ModelOutput)

    part.forward = stage_forward
    return part


def _drop_parameters(part: nn.Module, names: set[str], layout: SplitLayout) -> None:
    """Remove from `part` the parameters outside the blocks that another stage holds: a called
    module all of whose parameters are among them is replaced whole (`_Elsewhere`); any other such
    parameter becomes a zero buffer of its shape (its values reach nothing that counts)."""
    if not names:
        return
    container_path = layout.block_path
    replaced: set[str] = set()
    for path in layout.called:  # outermost first: named_modules order
        if any(path.startswith(r + ".") for r in replaced) or container_path.startswith(path + ".") \
                or container_path == path:
            continue
        mod = part.get_submodule(path)
        own = [f"{path}.{n}" for n, _ in mod.named_parameters()]
        if own and all(n in names for n in own):
            owner, _, attr = path.rpartition(".")
            setattr(part.get_submodule(owner) if owner else part, attr, _Elsewhere(mod))
            replaced.add(path)
    for name in sorted(names):
        if any(name.startswith(r + ".") for r in replaced):
            continue
        owner, _, attr = name.rpartition(".")
        mod = part.get_submodule(owner) if owner else part
        p = mod._parameters.pop(attr)
        mod.register_buffer(attr, torch.zeros_like(p, device="meta").detach(), persistent=False)


def stage_layout(model: nn.Module, example: tuple) -> SplitLayout | None:
    """None for a model that declares its stage modules (the declared split), else its layout
    checked on `example` inputs (ConfigError naming the module when it cannot be cut)."""
    return None if declares_stages(model) else split_layout(model, example)


def apply_pipeline_split(model: nn.Module, plan: Plan, pp_rank: int,
                         layout: SplitLayout | None = None) -> list[tuple[int, nn.Module]]:
    """(stage id, module) for every stage this rank runs (`layout`: see `split_stage`)."""
    return [(s, split_stage(model, plan, s, layout)) for s in stage_ids(plan, pp_rank)]


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
