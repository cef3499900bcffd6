"""Tensor and sequence parallelism with `parallelize_module`, styles derived from layer roles.

Roles (Megatron's column -> row chain): q/k/v and MLP up/gate are column-wise (each rank owns whole
heads / a slice of the hidden units), the attention output and MLP down projections are row-wise
(their partial sums are reduced once per sub-layer). The embedding is vocabulary-parallel
(row-wise over the vocabulary) and the output head column-wise over the vocabulary, its logits left
sharded for the loss-parallel cross entropy. With sequence parallelism the norms run on
sequence shards and the row-wise outputs are reduce-scattered instead of all-reduced.

Roles come from dtorch.model.tp_rules (layer names or `annotate(module, role)`), shared with the
profiler; so does the rule for parameters left whole inside the TP region (`mark_region`): their
modules run as data parallel over the TP group, their gradients summed.
"""

from __future__ import annotations

import inspect
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from dtorch.errors import ConfigError
from dtorch.model.structure import block_items, find_blocks
from dtorch.model.tp_rules import (  # noqa: F401 - annotate, ROLES: the public names
    REGION_ATTR,
    ROLE_BY_NAME,
    ROLES,
    SP_WHOLE_ATTR,
    TOP_ROLE_BY_NAME,
    _role,
    annotate,
    check_block,
    check_heads,
    is_sp_norm,
    layer_roles,
    mark_region,
)
from dtorch.parallel.halves import Half, Meshes
from dtorch.parallel.mesh import sub_mesh
from dtorch.parallel.rng import has_random_ops, shard_attention_streams, shard_streams
from dtorch.plan.strategies.memory import regathers


def _num_positional_inputs(module: nn.Module) -> int:
    params = inspect.signature(module.forward).parameters.values()
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty)


def block_plan(block: nn.Module, block_name: str, sp: bool) -> dict[str, object]:
    """The parallelize_module plan of one block, from its layers' roles (tp_rules.check_block)."""
    plan: dict[str, object] = {}
    rowwise_out = Shard(1) if sp else Replicate()
    roles = check_block(block, block_name)
    for name, mod in block.named_modules():
        role = roles.get(name)
        if role == "colwise":
            plan[name] = ColwiseParallel()
        elif role == "rowwise":
            plan[name] = RowwiseParallel(output_layouts=rowwise_out)
        elif role is None and getattr(mod, REGION_ATTR, False):
            # inside the region: this rank's part taken as shard 0 of the group's (tp_rules.mark_region);
            # the Partial gradients of its Replicate parameters are summed once per step
            plan[name] = SequenceParallel(sequence_dim=0, use_local_output=True)
        elif role is None and sp and is_sp_norm(name, mod):
            # local output: what follows a norm may be a residual add on this rank's shard (Gemma's
            # norm after the attention); a module needing whole sequences gathers on entry
            plan[name] = SequenceParallel(use_local_output=True)
    return plan


def check_roles(model: nn.Module, sp: bool) -> None:
    """Raise the ConfigError of the first layer without a tensor-parallel role (pure, no mesh), then
    mark the modules holding replicated parameters inside the TP region (`mark_region`)."""
    path, blocks = find_blocks(model)
    for name, block in block_items(blocks):
        block_plan(block, f"{path}.{name}", sp)
    mark_region(model, sp)  # (first: its line names the layer a halved forward would fail in)
    check_heads(model)


def gather_sequence_on_entry(block: nn.Module, plan: dict[str, object], tp_mesh: DeviceMesh,
                             regather: bool = False) -> None:
    """The module that owns a column-wise layer receives the sequence shards of the norm and needs
    the whole sequence: all-gather its first input (positional or by keyword) on entry. With
    `regather` what its layers save of the gathered input is kept as this rank's shard and gathered
    again in the backward (`_Regather`, as Megatron-LM's sequence parallelism does)."""
    owners = {name.rsplit(".", 1)[0] for name, style in plan.items()
              if isinstance(style, ColwiseParallel) and "." in name}
    for owner in owners:
        mod = block.get_submodule(owner)
        first = next(iter(inspect.signature(mod.forward).parameters))
        mod.register_forward_pre_hook(partial(_gather_first_input, mesh=tp_mesh, name=first, regather=regather),
                                      with_kwargs=True)
        if regather:
            mod.register_forward_hook(_end_regather, always_call=True)


def _gather_first_input(module: nn.Module, args: tuple, kwargs: dict, *, mesh: DeviceMesh, name: str,
                        local: bool = False, regather: bool = False):
    def gather(x):
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (Shard(1),), run_check=False)
        shard = x.to_local()
        x = x.redistribute(mesh, (Replicate(),))
        if regather and torch.is_grad_enabled():
            hooks = _Regather(shard, x.to_local(), mesh)
            module._dtorch_regather = torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack)
            module._dtorch_regather.__enter__()
        return x.to_local() if local else x

    if args:
        return (gather(args[0]), *args[1:]), kwargs
    return args, {**kwargs, name: gather(kwargs[name])}


def _end_regather(module: nn.Module, args: tuple, output) -> None:
    hooks = module.__dict__.pop("_dtorch_regather", None)
    if hooks is not None:
        hooks.__exit__(None, None, None)


class _Regather:
    """Saved-tensor hooks of one forward of a module whose input sequence parallelism all-gathered:
    a tensor saved for the backward that is (a view of) the gathered input is packed as this rank's
    shard, and unpacked by gathering the shards again, once: the gathered copy lives from the first
    layer's backward that needs it until the last one's. Every TP rank runs the same backward, so the
    gathers pair up. Memory per token between forward and backward: h/tp of the input instead of h."""

    def __init__(self, shard: torch.Tensor, full: torch.Tensor, mesh: DeviceMesh):
        self.shard, self.mesh, self.ptr = shard, mesh, full.untyped_storage().data_ptr()
        self.full: torch.Tensor | None = None

    def pack(self, t: torch.Tensor):
        local = t._local_tensor if isinstance(t, DTensor) else t
        if local.untyped_storage().data_ptr() != self.ptr:
            return t
        spec = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        return _Packed(local.shape, local.stride(), local.storage_offset(), spec)

    def unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed
        if self.full is None:
            with torch.no_grad():
                x = DTensor.from_local(self.shard, self.mesh, (Shard(1),), run_check=False)
                self.full = x.redistribute(self.mesh, (Replicate(),)).to_local()
        local = self.full.as_strided(packed.size, packed.stride, packed.offset)
        if packed.spec is None:
            return local
        mesh, placements, shape, stride = packed.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class _Packed:
    """Where a saved tensor lies in the gathered input (autograd keeps the unpack hook, and with it the
    shard, beside it)."""

    __slots__ = ("size", "stride", "offset", "spec")

    def __init__(self, size, stride, offset: int, spec):
        self.size, self.stride, self.offset, self.spec = size, stride, offset, spec


def run_whole_sequence(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Block children marked by mark_region (SP_WHOLE_ATTR: a mixture of experts under SP) take the
    whole sequence (all-gathered on entry) and return this rank's shard of their output. Every TP
    rank computes the same whole thing, so their parameters' gradients are complete (the backward
    of taking the shard gathers the output gradient; that of the gather keeps this rank's part)."""
    for _, child in block.named_children():
        if getattr(child, SP_WHOLE_ATTR, False):
            first = next(iter(inspect.signature(child.forward).parameters))
            child.register_forward_pre_hook(partial(_gather_first_input, mesh=tp_mesh, name=first, local=True),
                                            with_kwargs=True)
            child.register_forward_hook(partial(_keep_sequence_shard, mesh=tp_mesh))


def _keep_sequence_shard(module: nn.Module, args: tuple, output, *, mesh: DeviceMesh):
    def shard(x):
        return DTensor.from_local(x, mesh, (Replicate(),), run_check=False).redistribute(mesh, (Shard(1),)).to_local()

    if isinstance(output, tuple):
        return (shard(output[0]), *output[1:])
    return shard(output)


class _AllReduceGradTail(torch.autograd.Function):
    """Identity forward; backward all-reduces the last `width` features of the gradient over `group`."""

    @staticmethod
    def forward(ctx, x, width: int, group):
        ctx.width, ctx.group = width, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        tail = grad[..., -ctx.width:].contiguous()
        dist.all_reduce(tail, group=ctx.group)
        grad[..., -ctx.width:] = tail
        return grad, None, None


def _shared_rope_key_hook(module: nn.Module, args: tuple, output, *, width: int, group):
    return _AllReduceGradTail.apply(output, width, group)


def fix_latent_attention(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    """DeepSeek's latent attention (dtorch.models.moe.MLAttention) under TP: the one RoPE key that all
    heads share is the last qk_rope_head_dim outputs of the replicated `wkv_a`; each tp rank's heads
    give only their part of its gradient, which is summed over tp here (the latent's part is summed
    already where the column-wise `wkv_b` takes its input)."""
    for mod in block.modules():
        if hasattr(mod, "wkv_a") and isinstance(getattr(mod, "rope", None), int):
            mod.wkv_a.register_forward_hook(partial(_shared_rope_key_hook, width=mod.rope, group=tp_mesh.get_group()))


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sp: bool, loss_parallel: bool, last_stage: bool = True,
             regather: bool = False) -> None:
    """Parallelise `model` (one pipeline stage or the whole model) in place over `tp_mesh`.

    With sequence parallelism, the sequence-sharded region is the stage's run of blocks: the
    model's own code (RoPE tables sliced to the input length, GPT's position embeddings, a
    pipeline stage's input shape) then always sees whole sequences. The first block of the stage
    takes its shard by a local slice; the last block of a non-final stage all-gathers its output.
    Tied input/output embeddings stay tied: one vocabulary-sharded Parameter.
    """
    top: dict[str, object] = {}
    by_role: dict[str, list[nn.Module]] = {"embedding": [], "output": []}
    for name, mod in model.named_children():
        role = _role(name, mod, TOP_ROLE_BY_NAME) if mod is not None else None
        if role in by_role:
            by_role[role].append(mod)
        if role == "embedding":
            top[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif role == "output":
            top[name] = ColwiseParallel(
                input_layouts=Shard(1) if sp else Replicate(),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            )
        elif sp and name in ("norm", "ln_f") and mod is not None:
            top[name] = SequenceParallel()
    # Tied input/output embeddings (GPT-2) are one Parameter in two modules. parallelize_module
    # distributes it once per module, which would untie them; both shard the vocabulary (dim 0 of
    # the same [vocab, dim] weight), so the head takes the embedding's sharded Parameter back.
    tied = [(out, emb) for out in by_role["output"] for emb in by_role["embedding"]
            if getattr(out, "weight", None) is not None and out.weight is getattr(emb, "weight", None)]
    if top:
        parallelize_module(model, tp_mesh, top)
    for out, emb in tied:
        out.weight = emb.weight
    mark_region(model, sp)
    path, blocks = find_blocks(model)
    items = block_items(blocks)
    for name, block in items:
        bplan = block_plan(block, f"{path}.{name}", sp)
        parallelize_module(block, tp_mesh, bplan)
        fix_latent_attention(block, tp_mesh)
        if sp:
            gather_sequence_on_entry(block, bplan, tp_mesh, regather)
            run_whole_sequence(block, tp_mesh)
    if sp:
        # every random draw inside a sequence-parallel block is on a TP-sharded tensor (rng.py);
        # a block that draws nothing needs no stream switch (and stays traceable by torch.compile)
        shard_streams([block for _, block in items if has_random_ops(block)], tp_mesh)
        first, last = items[0][1], items[-1][1]
        n = _num_positional_inputs(first)
        parallelize_module(first, tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(),) + (None,) * (n - 1),
            desired_input_layouts=(Shard(1),) + (None,) * (n - 1),
            use_local_output=True,
        ))
        if not last_stage:
            parallelize_module(last, tp_mesh, PrepareModuleOutput(
                output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True,
            ))


# ---- the executor half (dtorch.parallel.halves) ---------------------------------------------------
def _check(model: nn.Module, plan, device_type: str | None) -> None:
    if plan.tp == 1:
        return
    check_roles(model, plan.sp)
    if plan.sp and any(hasattr(type(m), "dispatcher") for m in model.modules()):
        # a MoE block would receive sequence shards, route them apart and need the router's
        # gradient reduced over tp: not built (expert.py)
        raise ConfigError("sp", plan.sp, "sequence parallelism of a mixture-of-experts model is not implemented; "
                          "use sp=false with tp > 1")


def _apply(part: nn.Module, meshes: Meshes, plan) -> None:
    if plan.tp > 1:
        # (sequence parallelism's gathered inputs are re-gathered in the backward where no activation
        # checkpointing re-runs the gathers and no compiled block traces the hooks: `regathers`)
        apply_tp(part, meshes.tp, sp=plan.sp, loss_parallel=True, last_stage=meshes.last_stage,
                 regather=regathers(plan))


def _shard_streams(part: nn.Module, meshes: Meshes, plan) -> None:
    if plan.tp > 1 and not plan.sp:  # (with sp, whole blocks run on shard streams: apply_tp)
        shard_attention_streams(part, sub_mesh(meshes.mesh, "tp"))


HALVES = (Half(10, apply=_apply), Half(22, check=_check), Half(25, apply=_shard_streams))
