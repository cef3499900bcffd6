"""Mixed clusters: which device group each rank of a plan lands on, and how to apportion uneven work.

Pure functions over a `Cluster` and a plan's degrees (no torch, nothing of `dtorch.plan.plan`, so
the strategies may use them). See docs/heterogeneous.md.

Rank order (the executor's, `dtorch.parallel.mesh`): global ranks are node-major, the ranks of one
node contiguous, the node groups in the cluster's order (group 0's nodes first). The mesh is
``pp x dp_replicate x dp_shard x cp x tp`` with tp innermost, so the ``cp * tp`` ranks of one
*cell* (pipeline rank i, data-parallel rank d) are the contiguous block starting at
``(i * dp + d) * cp * tp``; data-parallel rank ``d = replicate_index * dp_shard + shard_index``.

A cell's tensor- and context-parallel groups must lie on one kind of device (`span_violation`):
their collectives run in lock-step, so a faster device in them only waits. Two ways then use
uneven devices, and the search compares them:

- pipeline stages of uneven size (`stage_partitions`): pipeline rank i's blocks in proportion to
  the speed (or the memory) of the slowest cell of the stage (`layer_partition`);
- uneven data-parallel work (`dp_shares`): data-parallel rank d's micro-batches per step in
  proportion to the speed of its slowest cell (the Plan field `dp_shares`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache

from dtorch.cluster.spec import Cluster, NodeGroup


def group_speed(group: NodeGroup, dtype: str = "bfloat16") -> float:
    """Achievable matmul FLOP/s of one device of `group` in `dtype` (peak x base efficiency; the
    measured numbers where `dtorch probe` wrote them); 0 if the device has no such arithmetic."""
    dev = group.device
    return dev.peak(dtype) * dev.matmul_efficiency if dev.supports(dtype) else 0.0


def group_bounds(cluster: Cluster) -> list[int]:
    """The first global rank of every group, and the world size last."""
    out = [0]
    for g in cluster.groups:
        out.append(out[-1] + g.num_devices)
    return out


def _groups_of(lo: int, hi: int, bounds: Sequence[int]) -> list[int]:
    """Indices of the groups holding ranks lo .. hi-1."""
    return [k for k in range(len(bounds) - 1) if bounds[k] < hi and lo < bounds[k + 1]]


def cell_groups(cluster: Cluster, pp: int, dp: int, cp: int, tp: int) -> tuple[tuple[int, ...], ...]:
    """[pipeline rank][data-parallel rank] -> the index of the group the cell's ``cp * tp`` ranks
    run on (the slowest one, should a cell span groups of equal devices)."""
    return _cells(tuple(group_bounds(cluster)), tuple(group_speed(g) for g in cluster.groups), pp, dp, cp * tp)


def column_groups(cluster: Cluster, pp: int, dp: int, cp: int, tp: int) -> tuple[tuple[int, ...], ...]:
    """[data-parallel rank] -> the groups of its pipeline ranks (`cell_groups` transposed)."""
    return _columns(tuple(group_bounds(cluster)), tuple(group_speed(g) for g in cluster.groups), pp, dp, cp * tp)


@lru_cache(maxsize=4096)
def _cells(bounds: tuple[int, ...], speed: tuple[float, ...], pp: int, dp: int, block: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(min(_groups_of((i * dp + d) * block, (i * dp + d + 1) * block, bounds), key=lambda k: speed[k])
                       for d in range(dp)) for i in range(pp))


@lru_cache(maxsize=4096)
def _columns(bounds: tuple[int, ...], speed: tuple[float, ...], pp: int, dp: int, block: int) -> tuple[tuple[int, ...], ...]:
    cells = _cells(bounds, speed, pp, dp, block)
    return tuple(tuple(row[d] for row in cells) for d in range(dp))


def span_violation(cluster: Cluster, cp: int, tp: int, cells: bool = True) -> tuple[str, int, str] | None:
    """(field, value, fix) when a tensor-parallel group is larger than a node of some group, or
    (with `cells`) a cell's tensor- and context-parallel ranks span two kinds of device; None when
    every group can hold its cells. The cells tile the world in blocks of ``cp * tp`` whatever pp
    and dp are (`cell_groups`)."""
    bounds, block = group_bounds(cluster), cp * tp
    for k, g in enumerate(cluster.groups):
        what = f"group {k} ({g.num_nodes} x {g.devices_per_node} {g.device.name})"
        if tp > g.devices_per_node:
            return "tp", tp, (f"{what} has {g.devices_per_node} devices per node and tensor parallelism stays in a node; "
                              f"use tp <= {g.devices_per_node}")
    straddled = sorted({b // block for b in bounds[1:-1] if b % block}) if cells else []
    for cell in straddled:  # (only a cell across a group boundary can span two kinds of device)
        ks = _groups_of(cell * block, (cell + 1) * block, bounds)
        other = next((k for k in ks[1:] if cluster.groups[k].device != cluster.groups[ks[0]].device), None)
        if other is not None:  # (two kinds of device, as `Cluster.homogeneous` tells them apart)
            ks = [ks[0], other]
            a, b = cluster.groups[ks[0]], cluster.groups[other]
            fld, val = ("cp", cp) if cp > 1 else ("tp", tp)
            sizes = math.gcd(*(g.num_devices for g in cluster.groups))
            return fld, val, (f"ranks {cell * block}-{(cell + 1) * block - 1} (a cp*tp={block} group) span group {ks[0]} "
                              f"({a.device.name}) and group {ks[1]} ({b.device.name}); tensor- and context-parallel "
                              f"groups stay on one kind of device: use cp*tp dividing {sizes}")
    return None


def apportion(total: int, weights: Sequence[float], unit: int = 1, minimum: int = 1) -> list[int]:
    """`total` split in proportion to `weights` (largest remainder), in multiples of `unit`, each at
    least `minimum` (rounded up to a unit). Sums to `total` (a multiple of `unit`)."""
    n, units = len(weights), total // unit
    low = -(-minimum // unit)
    if n * low > units:
        return [total // n] * n if total % n == 0 else [unit * (units // n + (i < units % n)) for i in range(n)]
    w = sum(weights) or 1.0
    share = [max(float(low), units * x / w) for x in weights]
    scale = (units - n * low) / max(sum(s - low for s in share), 1e-12)
    exact = [low + (s - low) * scale for s in share]
    base = [max(low, math.floor(e)) for e in exact]
    for i in sorted(range(n), key=lambda i: base[i] - exact[i])[: units - sum(base)]:
        base[i] += 1
    while sum(base) > units:  # (floors above the minimum can overshoot only by rounding)
        base[max(range(n), key=lambda i: base[i] - exact[i])] -= 1
    return [b * unit for b in base]


def dp_shares(cluster: Cluster, pp: int, dp: int, cp: int, tp: int, num_microbatches: int, schedule: str = "1f1b",
              dtype: str = "bfloat16") -> list[int] | None:
    """Micro-batches per step of each data-parallel rank in proportion to the speed of its slowest
    cell (a pipeline of them runs at its slowest stage's pace), summing to ``dp * num_microbatches``;
    None when the speeds give even shares. Pipelined schedules keep each rank's count valid: at
    least pp, in rounds of pp for the interleaved ones."""
    if dp < 2:
        return None
    cells = cell_groups(cluster, pp, dp, cp, tp)
    speed = [group_speed(g, dtype) for g in cluster.groups]
    w = [min(speed[cells[i][d]] for i in range(pp)) for d in range(dp)]
    if max(w) <= min(w) * 1.0001:
        return None
    rounds = pp > 1 and schedule in ("interleaved_1f1b", "zero_bubble")
    unit = pp if rounds else 1
    minimum = pp if pp > 1 and schedule != "gpipe" else 1
    shares = apportion(dp * num_microbatches, w, unit, minimum)
    return shares if len(set(shares)) > 1 and sum(shares) == dp * num_microbatches else None


def stage_weights(cluster: Cluster, pp: int, dp: int, cp: int, tp: int,
                  dtype: str = "bfloat16") -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(speed, memory) of every pipeline rank: its slowest cell's FLOP/s and its smallest device's bytes."""
    cells = cell_groups(cluster, pp, dp, cp, tp)
    groups = cluster.groups
    speed = tuple(min(group_speed(groups[k], dtype) for k in row) for row in cells)
    memory = tuple(float(min(groups[k].device.memory_bytes for k in row)) for row in cells)
    return speed, memory


def stage_partitions(pp: int, v: int, num_layers: int, head_blocks: float,
                     weights: Sequence[Sequence[float]]) -> list[list[int]]:
    """Stage partitions (pp * v block counts, looped placement: rank r runs stages r, r + pp, ...)
    giving each pipeline rank blocks in proportion to each of `weights` (speed, memory), the last
    rank's output head (worth `head_blocks` blocks) counted in its share; only those that differ
    from one another and whose ranks all keep at least v blocks."""
    out: list[list[int]] = []
    if pp < 2:
        return out
    for w in weights:
        if not w or max(w) <= min(w) * 1.0001:
            continue
        total, sw = num_layers + head_blocks, sum(w)
        target = [total * x / sw - (head_blocks if r == pp - 1 else 0.0) for r, x in enumerate(w)]
        per_rank = apportion(num_layers, [max(t, 1e-9) for t in target], 1, v)
        if sum(per_rank) != num_layers or min(per_rank) < v:
            continue
        sizes = [0] * (pp * v)
        for r, n in enumerate(per_rank):
            base, extra = divmod(n, v)
            for k in range(v):
                sizes[r + k * pp] = base + (1 if k < extra else 0)
        if sizes not in out:
            out.append(sizes)
    return out


def bound_group(cluster: Cluster) -> NodeGroup:
    """One group standing for the whole cluster in the search's lower bound: the fastest group's
    links and memory bandwidth, at the cluster's mean achievable FLOP/s per device (no plan can run
    faster than all devices busy all the time)."""
    groups = cluster.groups
    fast = max(groups, key=group_speed)
    W = cluster.world_size
    dev = fast.device

    def mean(dtype: str) -> float:
        return sum(g.num_devices * group_speed(g, dtype) for g in groups) / W / dev.matmul_efficiency

    peaks = {d: mean(d) for d in dev.peak_flops}
    return replace(fast, device=replace(dev, peak_flops=peaks,
                                        memory_bandwidth=max(g.device.memory_bandwidth for g in groups)))


def group_summary(cluster: Cluster, columns: dict[tuple, tuple[float, list[tuple[int, float, float]]]]) -> list[dict]:
    """Per group, what a mixed estimate gave its ranks: the global ranks it holds, the micro-batches
    per step and the blocks of its ranks (sorted distinct values), the slowest pipeline that runs
    on it (seconds), its fullest rank's bytes against its device's, and whether they fit.
    `columns`: (stage groups, micro-batches) -> (step seconds, [(group, bytes, blocks) per rank])."""
    bounds = group_bounds(cluster)
    out = []
    for k, g in enumerate(cluster.groups):
        mbs, blk, secs, used = set(), set(), 0.0, 0.0
        for (_, m), (step_s, ranks) in columns.items():
            for kk, nbytes, blocks in ranks:
                if kk == k:
                    mbs.add(m)
                    blk.add(blocks)
                    secs, used = max(secs, step_s), max(used, nbytes)
        cap = g.device.memory_bytes
        out.append({"group": k, "device": g.device.name, "ranks": f"{bounds[k]}-{bounds[k + 1] - 1}",
                    "microbatches": sorted(mbs), "blocks": sorted(blk), "step_s": secs,
                    "memory_bytes": int(used), "memory_capacity": int(cap), "fits": used <= cap})
    return out
