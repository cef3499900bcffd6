"""Expert parallelism (EP): the routed experts of every MoE block sharded over an ``ep`` mesh axis.

Where the ep ranks come from. EP does not add ranks of its own: it is *borrowed* from the ranks
that already split the tokens, the data-parallel ones (dp_shard, and cp where context parallelism
runs, as torchtitan does). Those ranks hold the same non-expert weights but different tokens; EP
gives each of `ep` consecutive ranks 1/ep of the experts instead of all of them, and moves every
token to the rank that holds its expert. So, with D = dp_replicate * dp_shard * cp data-parallel
ranks (tp ranks are not borrowed: tensor-parallel ranks see the same tokens)

    ep divides D;  edp = D / ep  ranks hold each expert ("expert data parallel")
    world = pp * D * tp  is unchanged by ep.

The 2-D mesh (`expert_mesh`) is ``(edp, ep)`` with ep innermost (consecutive ranks, the fastest
links for the all-to-all); its flattened ``dp`` axis covers all D ranks.

A step, per MoE block (`_dispatch`, installed as the `GroupedExperts.dispatcher` hook):
  1. routing runs unchanged on the rank's own tokens (identical to one process: the router is
     replicated and sees the same tokens), giving assignments sorted by expert and per-expert counts;
  2. the counts are exchanged (all_to_all_single, equal splits), so each rank learns how many rows
     it receives from every rank for each of its local experts;
  3. dispatch: the assignments' hidden states are exchanged with variable splits (rows for the
     experts of rank j go to rank j), regrouped from (source rank, expert) to (expert, source) order;
  4. the local experts compute, one matmul chain per expert (GroupedExperts.compute);
  5. combine: the inverse regrouping and the inverse all-to-all bring every output row back to
     the rank and position it came from; the model applies the gate weights and sums.
Both all-to-alls are autograd-aware (`_AllToAll`: backward is the all-to-all with the splits
swapped), so backward moves the gradients the same way in reverse. No token is dropped: the
split sizes are whatever the router chose (dropless); a `capacity_factor` in the model config
caps the counts before dispatch, identically with or without EP.

Gradients. The objective is the mean of the D ranks' losses. A non-expert weight is replicated on
all D ranks: its gradient is averaged over ``dp``. An expert weight lives on the edp ranks that
hold the same expert; each already received, through the all-to-all backward, the contributions
of all ep ranks of its group, so its gradient is *summed* over ``edp`` and divided by D (not by
edp): `all_reduce_gradients` does this for replicated training, and `apply_fsdp_with_experts`
shards the expert weights over ``edp`` with gradient divide factor D (torch's FSDP2) and the other
weights over ``dp``.

With data-parallel replicas (dp_replicate > 1) both are HSDP (`expert_mesh(..., dp_replicate=R)`):
an expert is replicated over the replicas its ep group does not span and sharded over the rest of
its edp ranks; the gradient arithmetic is the same (sum over edp, divide by D).

The auxiliary-loss-free bias update needs the expert loads of all D ranks: `apply_expert_parallel`
installs `MoETransformer.load_all_reduce` summing them over ``dp``.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtorch.errors import ConfigError
from dtorch.parallel.fsdp import mp_policy
from dtorch.parallel.halves import Half, Meshes

__all__ = ["apply_expert_parallel", "expert_mesh", "expert_parameters", "all_reduce_gradients",
           "apply_fsdp_with_experts", "dispatch_bytes", "replica_split"]


def replica_split(ep: int, dp_replicate: int, dp_shard: int) -> tuple[int, int] | None:
    """(k, m): how ep consecutive data-parallel ranks lie over (dp_replicate, dp_shard), ep = k*m
    with k replicas of m shard ranks each: inside one replica's shard group (k = 1, m | dp_shard),
    or over k whole replicas (m = dp_shard, k | dp_replicate). None if neither."""
    if dp_shard % ep == 0:
        return 1, ep
    if ep % dp_shard == 0 and dp_replicate % (ep // dp_shard) == 0:
        return ep // dp_shard, dp_shard
    return None


def expert_mesh(ep: int, device_type: str = "cpu", world_size: int | None = None, *, tp: int = 1,
                pp: int = 1, dp_replicate: int = 1) -> DeviceMesh:
    """The ``([pp,] edp, ep[, tp])`` mesh over `world_size` ranks (default: the whole world): the
    D = world/(pp*tp) data-parallel ranks split into ``(edp, ep)``, ep innermost of them, with the
    flattened ``dp`` axis (edp x ep) registered. Axes in the order of `dtorch.parallel.mesh`
    (pp outermost, tp innermost), so rank r has the same pp/dp/tp coordinates in both meshes, and
    with tp > 1 the ``tp`` axis of this mesh is the one tensor parallelism must use (FSDP needs the
    data- and tensor-parallel meshes of one parameter to share a root). Raises ConfigError if ep
    does not divide D.

    With replicas (`dp_replicate` = R > 1, D = R x dp_shard, replica-major as in the world mesh)
    the data-parallel ranks are ``(edp_rep, edp_shard, ep_rep, ep_shard)`` = (R/k, S/m, k, m) for
    ep = k*m (`replica_split`), flattened into ``ep`` (ep_rep, ep_shard), ``edp`` (edp_rep,
    edp_shard), ``dp`` (all four) and the world mesh's own ``dp_replicate`` x ``dp_shard`` split
    (the HSDP mesh of the non-expert weights). An expert is then held by the edp ranks, replicated
    over edp_rep and sharded over edp_shard (`apply_fsdp_with_experts`)."""
    world = dist.get_world_size() if world_size is None else world_size
    data = world // (tp * pp)
    if not isinstance(ep, int) or ep < 1 or data % ep:
        ok = [d for d in range(1, data + 1) if data % d == 0]
        raise ConfigError("ep", ep, f"must divide the {data} data-parallel ranks; use ep in {ok}")
    outer, inner = (("pp",), (pp,)) if pp > 1 else ((), ())
    last, last_n = (("tp",), (tp,)) if tp > 1 else ((), ())
    if dp_replicate > 1:
        shard = data // dp_replicate
        split = replica_split(ep, dp_replicate, shard)
        if split is None:
            ok = [d for d in range(1, data + 1) if data % d == 0 and replica_split(d, dp_replicate, shard)]
            raise ConfigError("ep", ep, f"with dp_replicate={dp_replicate} x dp_shard={shard}, ep ranks must lie "
                              f"inside one replica or over whole replicas; use ep in {ok}")
        k, m = split
        names = outer + ("edp_rep", "edp_shard", "ep_rep", "ep_shard") + last
        mesh = init_device_mesh(device_type, inner + (dp_replicate // k, shard // m, k, m) + last_n,
                                mesh_dim_names=names)
        mesh[("edp_rep", "edp_shard")]._flatten("edp")
        mesh[("ep_rep", "ep_shard")]._flatten("ep")
        mesh[("edp_rep", "edp_shard", "ep_rep", "ep_shard")]._flatten("dp")
        rep = ("edp_rep",) if k == 1 else ("edp_rep", "edp_shard", "ep_rep")
        mesh[rep]._flatten("dp_replicate")
        mesh[("edp_shard", "ep_rep", "ep_shard") if k == 1 else ("ep_shard",)]._flatten("dp_shard")
        return mesh
    names = outer + ("edp", "ep") + last
    shape = inner + (data // ep, ep) + last_n
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    mesh[("edp", "ep")]._flatten("dp")
    return mesh


def _replicated(mesh: DeviceMesh) -> bool:
    """Whether `mesh` (from `expert_mesh`) has data-parallel replicas (the HSDP layout)."""
    return "edp_rep" in (mesh.mesh_dim_names or ())


def _expert_modules(model: nn.Module) -> list[nn.Module]:
    """Modules that declare the `dispatcher` hook (dtorch.models.moe.GroupedExperts)."""
    return [m for m in model.modules() if hasattr(type(m), "dispatcher")]


def expert_parameters(model: nn.Module) -> set[int]:
    """ids of the routed-expert parameters (sharded over ep; reduced over edp)."""
    return {id(p) for m in _expert_modules(model) for p in m.parameters()}


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None = None) -> None:
    """Keep on this rank only its part of every MoE block's routed experts and install the dispatcher.

    `mesh`: from `expert_mesh` (axes ``edp``, ``ep``; its ``dp`` axis sums the expert loads for the
    bias update), or None without EP. `tp_mesh` (tensor parallelism, the ``tp`` axis of the same
    root mesh): each expert is also split Megatron-style over the tp ranks, w1/w3 by rows (hidden
    units) and w2 by columns, so that a tp rank computes a partial sum of every expert's output;
    the dispatcher all-reduces the routed output over tp (`_ReduceFromTP`) and the gradient of its
    input (`_CopyToTP`). TP ranks see the same tokens and route identically, so each ep group (the
    ranks of one tp coordinate) exchanges the same rows. Expert weights become DTensors ``Shard(0)``
    over ep and ``Shard(1)``/``Shard(2)`` over tp. Works on a meta-device model too (then
    `init_weights` fills each rank's shard with the single-process values).

    Raises ConfigError when ep does not divide a block's number of experts, or tp its expert hidden size."""
    from torch.distributed.tensor import DTensor, Shard

    ep_mesh = mesh["ep"] if mesh is not None else None
    ep, rank = (ep_mesh.size(), ep_mesh.get_local_rank()) if ep_mesh is not None else (1, 0)
    tp = tp_mesh.size() if tp_mesh is not None else 1
    if ep_mesh is not None and tp > 1:
        place_mesh = mesh[("ep", "tp")]
    else:
        place_mesh = ep_mesh if ep_mesh is not None else tp_mesh
    if place_mesh is None:
        return
    for experts in _expert_modules(model):
        n, hidden = experts.w1.shape[0], experts.w1.shape[1]
        if n % ep:
            ok = [d for d in range(1, n + 1) if n % d == 0]
            raise ConfigError("ep", ep, f"must divide n_experts={n}; use ep in {ok}")
        if hidden % tp:
            ok = [d for d in range(1, hidden + 1) if hidden % d == 0]
            raise ConfigError("tp", tp, f"must divide the expert hidden size {hidden} of a MoE model; use tp in {ok}")
        local, t_rank = n // ep, (tp_mesh.get_local_rank() if tp > 1 else 0)
        for name, p in list(experts.named_parameters(recurse=False)):
            shard = p.detach()[rank * local:(rank + 1) * local]
            placements = [Shard(0)] if ep_mesh is not None else []
            if tp > 1:  # w1, w3 [E, hidden, dim]: rows; w2 [E, dim, hidden]: columns
                hdim = 2 if name == "w2" else 1
                shard = shard.narrow(hdim, t_rank * (hidden // tp), hidden // tp)
                placements.append(Shard(hdim))
            dt = DTensor.from_local(shard.clone(), place_mesh, placements, run_check=False)
            setattr(experts, name, nn.Parameter(dt, requires_grad=p.requires_grad))
        experts.dispatcher = partial(_dispatch, group=ep_mesh.get_group() if ep_mesh is not None else None, ep=ep,
                                     tp_group=tp_mesh.get_group() if tp > 1 else None)
    if hasattr(type(model), "load_all_reduce") and mesh is not None:
        dp_group = mesh["dp"].get_group()
        model.load_all_reduce = partial(dist.all_reduce, group=dp_group)


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over tp (each tp rank's experts hold a
    slice of the hidden units, so each contributes a partial gradient of their common input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce (sum) of the tp ranks' partial expert outputs; backward passes the (replicated)
    gradient through unchanged."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits along dim 0; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def _expert_major(recv: torch.Tensor) -> torch.Tensor:
    """Row order that turns the received buffer, (source rank, local expert)-major with recv[i, j]
    rows per chunk, into (local expert, source rank)-major."""
    sizes = recv.flatten()
    starts = (sizes.cumsum(0) - sizes).view_as(recv)
    parts = [torch.arange(int(starts[i, j]), int(starts[i, j] + recv[i, j]))
             for j in range(recv.shape[1]) for i in range(recv.shape[0]) if recv[i, j]]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _dispatch(experts: nn.Module, x: torch.Tensor, counts: list[int], *, group, ep: int, tp_group=None) -> torch.Tensor:
    """The GroupedExperts.dispatcher of expert (and expert-tensor) parallelism (see the module
    docstring, steps 2-5; with `tp_group`, the tp reductions of `apply_expert_parallel`)."""
    if tp_group is not None:
        x = _CopyToTP.apply(x, tp_group)
    if ep == 1:
        y = experts.compute(x, counts)
    else:
        local = len(counts) // ep
        send = torch.tensor(counts, dtype=torch.int64, device=x.device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_m, recv_m = send.view(ep, local).cpu(), recv.view(ep, local).cpu()
        in_splits, out_splits = send_m.sum(1).tolist(), recv_m.sum(1).tolist()
        received = _AllToAll.apply(x, out_splits, in_splits, group)
        order = _expert_major(recv_m).to(x.device)
        y = experts.compute(received[order], recv_m.sum(0).tolist())
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=x.device)
        y = _AllToAll.apply(y[back], in_splits, out_splits, group)
    return _ReduceFromTP.apply(y, tp_group) if tp_group is not None else y


def dispatch_bytes(counts_sent: list[int], hidden: int, element_bytes: int, rank: int, ep: int) -> int:
    """Bytes this rank sends to *other* ranks in one dispatch (the combine sends as many back):
    rows for experts held elsewhere times hidden times the element size."""
    local = len(counts_sent) // ep
    off_rank = sum(c for e, c in enumerate(counts_sent) if e // local != rank)
    return off_rank * hidden * element_bytes


@torch.no_grad()
def all_reduce_gradients(model: nn.Module, mesh: DeviceMesh) -> None:
    """Replicated data parallelism with EP: non-expert gradients averaged over ``dp``; expert
    gradients summed over ``edp`` and divided by the dp size (see the module docstring). Parameters
    without a gradient are skipped."""
    dp_group, edp_mesh = mesh["dp"].get_group(), mesh["edp"]
    world = mesh["dp"].size()
    experts = expert_parameters(model)
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if id(p) in experts:
            if edp_mesh.size() > 1:
                dist.all_reduce(g, group=edp_mesh.get_group())
        else:
            dist.all_reduce(g, group=dp_group)
        g.div_(world)


def apply_fsdp_with_experts(model: nn.Module, mesh: DeviceMesh, **fsdp_kwargs) -> None:
    """FSDP2 with EP: every block's expert weights are one FSDP unit over ``edp`` (gradient divide
    factor = dp size, so that the sum over the ep group becomes the global mean), the rest of each
    block one unit over ``dp``, the embedding/head the root unit. Call after apply_expert_parallel.

    With replicas (`expert_mesh(..., dp_replicate=R)`) both are HSDP: the non-expert weights over
    the world mesh's (dp_replicate, dp_shard), the experts over (edp_rep, edp_shard), i.e. replicated
    over the replicas the ep group does not span and sharded over the rest (a DDP plan, dp_shard=1,
    shards over one rank: replicated, DDP's memory)."""
    from torch.distributed.fsdp import fully_shard

    world = mesh["dp"].size()
    if _replicated(mesh):
        expert_dp, rest = mesh[("edp_rep", "edp_shard")], mesh[("dp_replicate", "dp_shard")]
    else:
        expert_dp, rest = mesh["edp"], mesh["dp"]
    # the ranks FSDP shards the experts over (the last axis of an HSDP mesh)
    shard_group = (expert_dp[expert_dp.mesh_dim_names[-1]] if expert_dp.ndim > 1 else expert_dp).get_group()
    for experts in _expert_modules(model):
        fully_shard(experts, mesh=expert_dp, **fsdp_kwargs)
        experts.set_gradient_divide_factor(float(world))
        # gloo has no PREMUL_SUM: sum, then divide. Not over one shard rank: torch 2.13 then divides by
        # the factor when it copies the unreduced gradient and again after the (HSDP) all-reduce
        if shard_group.size() > 1 and dist.get_backend(shard_group) == "gloo":
            experts.set_force_sum_reduction_for_comms(True)
    layers = getattr(model, "layers", None)
    for block in (layers.values() if isinstance(layers, nn.ModuleDict) else layers or []):
        fully_shard(block, mesh=rest, **fsdp_kwargs)
    fully_shard(model, mesh=rest, **fsdp_kwargs)


# ---- the executor half (dtorch.parallel.halves) ---------------------------------------------------
def _apply(part: nn.Module, meshes: Meshes, plan) -> None:
    if meshes.ep is not None or (meshes.moe and meshes.tp is not None):
        # experts sharded over ep (all-to-all dispatcher) and/or their hidden units over tp
        apply_expert_parallel(part, meshes.ep, meshes.tp)


def _shard(part: nn.Module, meshes: Meshes, plan) -> None:
    if meshes.ep is not None:  # experts FSDP'd over edp (gradients summed over ep), the rest over all ranks
        # (a DDP plan's units shard over one rank: nothing to free, so they never reshard; ZeRO-1/2
        # keep them gathered all step, dtorch.parallel.zero)
        apply_fsdp_with_experts(part, meshes.ep, mp_policy=mp_policy(plan),
                                reshard_after_forward=plan.reshard_after_forward and plan.dp_shard > 1
                                and not getattr(plan, "zero", 0))


HALVES = (Half(30, apply=_apply), Half(60, apply=_shard))
