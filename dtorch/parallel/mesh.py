"""The DeviceMesh of a plan: named axes ``pp, dp_replicate, dp_shard, cp, tp`` (outermost first).

Only axes with degree > 1 are built (a size-1 axis would cost a process group and mean nothing);
the data-parallel axes are flattened into ``dp`` (data loading, loss averaging) and
``dp_replicate`` x ``dp_shard`` stay a 2-D sub-mesh for HSDP. With context parallelism,
``dp_shard`` x ``cp`` is flattened into ``dp_shard_cp``, the axis FSDP shards and reduces
gradients over (`fsdp_mesh`). TP is innermost so that it lands on
a node's contiguous (fastest-linked) ranks. The backend follows the device: nccl on CUDA, gloo on
CPU, chosen from the environment, never from the plan.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtorch import env
from dtorch.plan.plan import MESH_AXES, Plan


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is present, else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", (env.current().local_rank or 0) % torch.cuda.device_count())
    return torch.device("cpu")


def ensure_process_group(device: torch.device) -> None:
    """Join the default process group from the launcher's environment if nobody did yet."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


_MESHES: dict[tuple, tuple[object, DeviceMesh]] = {}


def build_mesh(plan: Plan, device_type: str, *, cache: bool = True) -> DeviceMesh:
    """World mesh over the plan's enabled axes, with the flattened ``dp`` axis registered.

    Meshes are cached per (process group, shape) so that re-applying a plan (tests, a re-plan of
    the same world) reuses its process groups instead of creating new ones.
    """
    names = tuple(a for a in MESH_AXES if getattr(plan, a) > 1)
    if not names:  # one rank, or a plan that replicates nothing: a 1-D mesh over the world
        names = ("dp_replicate",)
    shape = tuple(getattr(plan, a) for a in names)
    world = dist.group.WORLD
    # The cache holds the world group object itself, so a group destroyed and re-created (an
    # elastic restart) can never be mistaken for the old one by a reused id().
    key = (id(world), dist.get_rank(), device_type, names, shape)
    if cache and key in _MESHES and _MESHES[key][0] is world:
        return _MESHES[key][1]
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    dp_axes = tuple(a for a in ("dp_replicate", "dp_shard") if a in names)
    if len(dp_axes) == 2:
        mesh[dp_axes]._flatten("dp")
    if "dp_shard" in names and "cp" in names:
        mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    if cache:
        _MESHES[key] = (world, mesh)
    return mesh


def sub_mesh(mesh: DeviceMesh | None, *axes: str) -> DeviceMesh | None:
    """The sub-mesh over `axes` that exist in `mesh` (None if none do). ``dp`` is the flattened one."""
    if mesh is None:
        return None
    names = mesh.mesh_dim_names or ()
    present = tuple(a for a in axes if a in names)
    if axes == ("dp",):
        if "dp_replicate" in names and "dp_shard" in names:
            return mesh["dp"]
        present = tuple(a for a in ("dp_replicate", "dp_shard") if a in names)
    if not present:
        return None
    return mesh[present]


def fsdp_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The mesh FSDP shards parameters over and averages gradients over: ``dp_shard`` x ``cp``
    (flattened), preceded by ``dp_replicate`` for HSDP. Context-parallel ranks hold the same
    parameters but see different tokens, so their gradients must be averaged like those of data
    parallel ranks; sharding over them too saves memory at no extra communication (torchtitan)."""
    if mesh is None:
        return None
    names = mesh.mesh_dim_names or ()
    shard = tuple(a for a in ("dp_shard", "cp") if a in names)
    if len(shard) == 2:
        shard = ("dp_shard_cp",)
    axes = (("dp_replicate",) if "dp_replicate" in names else ()) + shard
    return mesh[axes] if axes else None
