"""Measured device groups: ranks whose measured speed differs become groups of their own.

Two GPUs of one name can run at different speeds (thermal throttling, a busy neighbour, a CPU
quota). `dtorch probe` measures each rank's GEMM speed and memory; `speed_classes` sorts the ranks
into classes whose members run within `threshold` of each other, and `measured_cluster` writes
the cluster as one node group per contiguous run of ranks of one class, each with its own measured
peak and memory, so the planner sees a heterogeneous cluster (docs/heterogeneous.md). Device names
stay those of the probed device for the fastest class and get ``-slow``, ``-slow2``, ... for the
others: distinct device types, the existing cluster-file format. Pure functions; no processes.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

from dtorch.cluster.spec import Cluster, NodeGroup
from dtorch.errors import ConfigError

SPEED_THRESHOLD = 0.15
"""Ranks more than 15 % slower than the fastest rank of their class start a class of their own
(a quiet machine measures ranks of one device within a few per cent of each other)."""


def speed_classes(speeds: Sequence[float], threshold: float = SPEED_THRESHOLD) -> list[int]:
    """Class of each rank (0 = fastest). Ranks are taken fastest first; a rank more than
    `threshold` (a fraction) slower than the first rank of the current class opens the next class."""
    if not speeds or any(not (s > 0) for s in speeds):
        raise ConfigError("speeds", list(speeds), "give one positive measured speed per rank")
    if not 0 < threshold < 1:
        raise ConfigError("speed_threshold", threshold, "a fraction in (0, 1), e.g. 0.15")
    order = sorted(range(len(speeds)), key=lambda r: -speeds[r])
    out = [0] * len(speeds)
    cls, head = 0, speeds[order[0]]
    for r in order:
        if speeds[r] < head * (1 - threshold):
            cls, head = cls + 1, speeds[r]
        out[r] = cls
    return out


def class_runs(classes: Sequence[int], ranks_per_node: int) -> list[tuple[int, int, int]]:
    """(class, first rank, rank count) of each contiguous run of one class in rank order, split at
    node boundaries (a node group is whole nodes, or part of one node)."""
    runs: list[tuple[int, int, int]] = []
    for r, c in enumerate(classes):
        if runs and runs[-1][0] == c and r % ranks_per_node != 0:
            runs[-1] = (c, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((c, r, 1))
    return runs


def measured_cluster(base: Cluster, speeds: Sequence[float], memory_bytes: Sequence[int] | None = None,
                     threshold: float = SPEED_THRESHOLD) -> Cluster:
    """`base` (a one-group cluster of len(speeds) ranks, already calibrated) split into groups by
    measured speed. `speeds`: each rank's measured FLOP/s (any unit: only ratios matter);
    `memory_bytes`: each rank's usable memory (None: the base device's). A class's peak FLOP/s is
    the base device's scaled by the class's mean speed over the median speed of all ranks (the
    probe's calibrated GEMM curve is the median over ranks). One class: `base` unchanged but for the memory."""
    if len(base.groups) != 1:
        raise ConfigError("cluster", base.describe(), "measured groups are made from one probed group")
    g0 = base.groups[0]
    if len(speeds) != g0.num_devices:
        raise ConfigError("speeds", list(speeds), f"give {g0.num_devices} speeds, one per rank")
    classes = speed_classes(speeds, threshold)
    mean = {c: sum(s for s, k in zip(speeds, classes) if k == c) / classes.count(c) for c in set(classes)}
    median = statistics.median(speeds)  # as the probe's calibrated curve: the median over ranks per shape
    groups: list[NodeGroup] = []
    for c, first, count in class_runs(classes, g0.devices_per_node):
        scale = mean[c] / median  # the calibrated peak is the median rank's
        name = g0.device.name if c == 0 else f"{g0.device.name.rstrip('*')}-slow{'' if c == 1 else c}"
        mem = g0.device.memory_bytes
        if memory_bytes is not None:
            mem = int(min(memory_bytes[first:first + count]))
        dev = dataclasses.replace(g0.device, name=name, memory_bytes=mem,
                                  peak_flops={k: v * scale for k, v in g0.device.peak_flops.items()})
        whole = count % g0.devices_per_node == 0 and first % g0.devices_per_node == 0
        groups.append(dataclasses.replace(g0, device=dev, num_nodes=count // g0.devices_per_node if whole else 1,
                                          devices_per_node=g0.devices_per_node if whole else count))
    # merge consecutive groups of one class that are whole nodes each (a run split only at node ends)
    merged: list[NodeGroup] = []
    for g in groups:
        last = merged[-1] if merged else None
        if (last is not None and last.device == g.device and last.devices_per_node == g.devices_per_node
                == g0.devices_per_node):
            merged[-1] = dataclasses.replace(last, num_nodes=last.num_nodes + g.num_nodes)
        else:
            merged.append(g)
    calib = {**base.calibration, "speed_classes": classes, "speed_threshold": threshold,
             "rank_speeds": list(speeds)}
    return Cluster(groups=merged, name=base.name if len(merged) == 1 else f"{base.name}:measured",
                   calibration=calib)
