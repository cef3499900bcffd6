"""Communication times of the cost model: alpha-beta collectives over a mesh axis and point-to-point
sends (see `dtorch.plan.cost` for the sources). Shared by the cost model and the strategies' terms."""

from __future__ import annotations

import math
from functools import lru_cache

from dtorch.cluster.spec import NodeGroup


def axis_layout(stride: int, size: int, devices_per_node: int) -> tuple[int, int]:
    """(ranks of the axis group per node, nodes the group spans) for contiguous node-major ranks."""
    if size <= 1:
        return 1, 1
    if stride >= devices_per_node:
        return 1, size
    k = max(1, min(size, devices_per_node // stride))
    return k, math.ceil(size / k)


@lru_cache(maxsize=65536)
def _coll(kind: str, nbytes: float, k: int, m: int, bi: float, ai: float, be: float, ae: float) -> float:
    """Seconds for one collective over a group of k ranks per node x m nodes (see module doc)."""
    n = k * m
    if n <= 1 or nbytes <= 0:
        return 0.0
    factor = 2.0 if kind == "all_reduce" else 1.0
    t = 0.0
    if k > 1:
        t += factor * (nbytes * (k - 1) / k / bi + (k - 1) * ai)
    if m > 1:
        t += factor * ((nbytes / k) * (m - 1) / m / be + math.ceil(math.log2(m)) * ae)
    return t


def collective_time(kind: str, nbytes: float, size: int, stride: int, group: NodeGroup) -> float:
    """Seconds for `kind` in {'all_gather', 'reduce_scatter', 'all_reduce'} of a full array of
    `nbytes` over a mesh axis of `size` ranks at rank stride `stride` (alpha-beta, hierarchical)."""
    if size <= 1 or nbytes <= 0:
        return 0.0  # (what _coll returns; checked first because the search asks this often)
    dpn = group.devices_per_node
    if stride >= dpn:
        k, m = 1, size
    else:  # axis_layout, inlined (the search calls this a few hundred thousand times)
        k = dpn // stride
        k = size if k > size else (k if k >= 1 else 1)
        m = -(-size // k)
    intra, inter = group.intra, group.inter
    return _coll(kind, float(nbytes), k, m, intra.bandwidth * intra.efficiency, intra.latency,
                 inter.bandwidth * inter.efficiency, inter.latency)


def unit_fixed(size: int, stride: int, group: NodeGroup) -> tuple[float, float, float, float] | None:
    """(all-gather s, reduce-scatter s, all-gather s per byte, reduce-scatter s per byte) of one FSDP
    unit over a mesh axis of `size` ranks at `stride`, as the probe measured them on this node's
    link (`Link.unit_gather_s`...: the fixed part mostly host work, so the same for any axis inside
    the node), or None where unmeasured or where the axis leaves the node (the ring then prices it)."""
    link = group.intra
    if size <= 1 or stride * size > group.devices_per_node or not (link.unit_gather_s or link.unit_reduce_s):
        return None
    return link.unit_gather_s, link.unit_reduce_s, link.unit_gather_s_per_byte, link.unit_reduce_s_per_byte


def functional_time(kind: str, nbytes: float, size: int, stride: int, group: NodeGroup) -> float:
    """`collective_time` of a functional collective (CP's K/V exchange, TP's redistributions): where
    the probe timed one to its wait on this node's link (`Link.func_latency_s`, per ring step) and
    the axis stays in the node, that fixed cost replaces the ring fit's latency; the bytes cost what
    they cost. TP's DTensor placement logic is not in it: the host term prices every TP operator
    as a DTensor operator already (`dtensor_op_overhead_s`)."""
    step = group.intra.func_latency_s
    if size <= 1 or nbytes <= 0 or not step or stride * size > group.devices_per_node:
        return collective_time(kind, nbytes, size, stride, group)
    fixed = (size - 1) * step * (2 if kind == "all_reduce" else 1)
    return collective_time(kind, nbytes, size, stride, group) - collective_time(kind, 1.0, size, stride, group) + fixed


def oversubscribed(group: NodeGroup) -> bool:
    """A CPU node running more ranks than it has cores: the ranks time-share the cores."""
    return group.device.kind == "cpu" and 0 < group.host_cores < group.devices_per_node


def sync_skew(link, segment_s: float, size: int) -> float:
    """Seconds one blocking collective over `size` ranks of `link` costs for the slowest peer after
    `segment_s` of the rank's own work (`Link.skew`). The probe times the whole cycle of compute and
    collective with every rank of the node in such a group, so where the ranks outnumber the cores
    the figure already counts the core a waiting rank lends to a peer."""
    return link.skew(segment_s, size)


def p2p_time(nbytes: float, stride: int, group: NodeGroup) -> float:
    """Seconds to send `nbytes` to the neighbour `stride` ranks away. The probe's point-to-point
    latency is a ping-pong of idle ranks; on an oversubscribed CPU a pipeline's receive waits for a
    busy peer to be scheduled, which is what a ring step's latency (measured with all ranks
    contending) prices."""
    link = group.intra if stride < group.devices_per_node else group.inter
    latency = link.latency if oversubscribed(group) else (link.p2p_latency or link.latency)
    return nbytes / (link.bandwidth * link.efficiency) + latency


def prefetched(comm_unit: float, compute_unit: float, units: float, c, contention: float = 0.0) -> float:
    """Exposed seconds of `units` transfers of `comm_unit` seconds each, issued one unit ahead of the
    compute that needs them (FSDP2's gathers, its and DDP's gradient reductions behind the next
    unit's backward): one transfer is never hidden (the first gather, the last reduction), every
    other hides behind one unit's `compute_unit` up to the overlappable share `c.fsdp_overlap`
    (a comm-bound unit shows the difference), and what hides slows the compute under it by
    `contention` of its time (`StepShape.contention`). On a CPU (`fsdp_overlap` 0) nothing hides."""
    if units <= 0 or comm_unit <= 0:
        return 0.0
    shown = max(0.0, comm_unit - c.fsdp_overlap * compute_unit)
    rest = comm_unit + max(0.0, units - 1.0) * (shown + contention * (comm_unit - shown))
    return max(rest, c.dp_exposed_floor * comm_unit * units)
