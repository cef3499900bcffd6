"""The cluster a launched job actually runs on, as the planner should see it.

`detect()` describes this machine; a job of `world_size` ranks with `LOCAL_WORLD_SIZE` ranks per
node is `world_size / LOCAL_WORLD_SIZE` such nodes. On a CPU machine every rank is a "device" that
gets an equal share of the cores' FLOP/s and of the memory (they run side by side).
"""

from __future__ import annotations

import dataclasses
import os

from dtorch import env
from dtorch.cluster.calibration_store import with_stored_calibration
from dtorch.cluster.machine import cpu_device, detect
from dtorch.cluster.spec import Cluster
from dtorch.errors import ConfigError


def default_workers() -> int:
    """The worker processes `dtorch train` starts by default: one per local GPU, else 2 on a CPU."""
    if os.path.exists("/dev/nvidia0") or os.path.exists("/dev/kfd"):
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return torch.cuda.device_count()
    return 2


def local_cluster(world_size: int, local_world_size: int | None = None, *, calibrated: bool = True,
                  workload: tuple[int, int, int] | None = None) -> Cluster:
    """This machine (times the number of nodes of the job) for a job of `world_size` ranks. On a CPU
    the speed of each precision is measured once for a block of `workload` = (hidden, heads, seq),
    the model's shape where known (see `dtorch.cluster.capability`).

    With `calibrated` (default), a calibration that `dtorch probe` stored for this cluster's name
    (``local:<nodes>x<ranks per node>``) is merged over the nominal numbers."""
    local = int(local_world_size or env.current().local_world_size or world_size)
    if world_size % local:
        raise ConfigError("world_size", world_size, f"must be a multiple of the ranks per node ({local})")
    base = detect()
    group = base.groups[0]
    dev = group.device
    if dev.kind == "cpu":
        # the precisions as one rank sees them: measured (once, cached) with a rank's share of threads
        dev = cpu_device(max(1, (os.cpu_count() or 1) // local), measure=True, workload=workload)
        dev = dataclasses.replace(
            dev,
            name=f"{dev.name}/{local}",
            peak_flops={k: v / local for k, v in dev.peak_flops.items()},
            mfu_peak_flops={k: v / local for k, v in dev.mfu_peak_flops.items()},
            memory_bytes=dev.memory_bytes // local,
            memory_bandwidth=dev.memory_bandwidth / local,
        )
    elif local > group.devices_per_node:
        raise ConfigError("nproc_per_node", local, f"this node has {group.devices_per_node} GPUs")
    group = dataclasses.replace(group, device=dev, devices_per_node=local, num_nodes=world_size // local,
                                host_cores=os.cpu_count() or 1)
    cluster = Cluster([group], name=f"local:{world_size // local}x{local}", calibration=base.calibration)
    if calibrated:
        cluster = with_stored_calibration(cluster)
    return cluster
