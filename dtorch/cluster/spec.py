"""What the hardware is: devices, nodes, links. Pure data; imports nothing of DTorch but errors.

Units: FLOP/s, bytes, bytes/s, seconds. Bandwidths are per device, one direction (a DGX-class node
has one NIC per GPU, so the inter-node bandwidth of a device is its NIC's). The cost model reads
these numbers; `dtorch probe` replaces nominal ones with measured ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DeviceType:
    """One kind of accelerator (or a CPU socket acting as one)."""

    name: str
    peak_flops: dict[str, float]
    """Dense peak FLOP/s by dtype name ('bfloat16', 'float16', 'float32', 'float8')."""
    memory_bytes: int
    """Usable device memory in bytes."""
    memory_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    matmul_efficiency: float = 0.6
    """Achievable fraction of peak for large GEMMs (calibrated by probe)."""
    kind: str = "cuda"
    """'cuda', 'rocm' or 'cpu': chooses the backend (nccl/gloo) at run time."""
    op_overhead_s: float = 0.0
    """Host seconds per operator of an eager training step (Python, dispatcher, autograd, launch);
    0 = unknown (no host-overhead term). `dtorch probe` measures it."""
    dtensor_op_overhead_s: float = 0.0
    """Extra host seconds per operator on DTensors (sharding propagation); 0 = unknown."""
    elementwise_speed: dict[str, float] = field(default_factory=dict)
    """Element-wise throughput (elements/s) of each dtype over float32's. Empty: memory-bound, so a
    16-bit element costs half a float32 one (a GPU). A CPU converts 16-bit values to float32 to
    compute, so there it is measured (`dtorch.cluster.capability`)."""
    attention_flops: dict[str, tuple[tuple[float, float, float], ...]] = field(default_factory=dict)
    """Per dtype, measured (head_dim, seq_len, FLOP/s) of the attention kernel: causal SDPA forward +
    backward, its FLOPs counted over the full s x s scores as the cost model counts them. Empty:
    unmeasured, the attention core runs at the GEMM speed (a spec sheet gives no such number).
    Measured by the probe (`dtorch.cluster.probe.measure_attention`): on a CPU the kernel runs at a
    fraction of the GEMM speed that depends on head_dim (4-5x below it at head_dim 16)."""
    mfu_peak_flops: dict[str, float] = field(default_factory=dict)
    """Peak FLOP/s by dtype that MFU divides by, where it differs from `peak_flops`: a CPU's cost-model
    `peak_flops` is scaled to what its kernels achieve, its MFU peak is the theoretical one detected
    from its features (`dtorch.cluster.peak`). Empty: `peak_flops` (a spec sheet's)."""

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s in `dtype`. A dtype the sheet does not list is not supported (KeyError):
        the planner never assumes a precision the hardware does not have."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if dtype == "float16" and "bfloat16" in self.peak_flops and self.kind != "cpu":
            return self.peak_flops["bfloat16"]  # GPU tensor cores run both 16-bit formats alike
        raise KeyError(dtype)

    def mfu_peak(self, dtype: str) -> float:
        """The peak FLOP/s in `dtype` that MFU divides by (`mfu_peak_flops`, else `peak`)."""
        return self.mfu_peak_flops.get(dtype) or self.peak(dtype)

    def supports(self, dtype: str) -> bool:
        try:
            self.peak(dtype)
        except KeyError:
            return False
        return True

    def attention_speed(self, dtype: str, head_dim: float, seq_len: float) -> float | None:
        """FLOP/s of the attention kernel in `dtype` at `head_dim` and `seq_len` (see
        `attention_flops`): interpolated in log space over the measured grid, held at its edges;
        None where unmeasured."""
        pts = self.attention_flops.get(dtype)
        if not pts:
            return None
        ds = sorted({p[0] for p in pts})
        ss = sorted({p[1] for p in pts})
        table = {(p[0], p[1]): p[2] for p in pts}

        def bracket(xs: list[float], x: float) -> tuple[float, float, float]:
            if x <= xs[0] or len(xs) == 1:
                return xs[0], xs[0], 0.0
            if x >= xs[-1]:
                return xs[-1], xs[-1], 0.0
            hi = next(i for i, v in enumerate(xs) if v >= x)
            lo_v, hi_v = xs[hi - 1], xs[hi]
            return lo_v, hi_v, math.log(x / lo_v) / math.log(hi_v / lo_v)

        d0, d1, fd = bracket(ds, float(head_dim))
        s0, s1, fs = bracket(ss, float(seq_len))
        corners = [(d0, s0), (d1, s0), (d0, s1), (d1, s1)]
        if any(c not in table for c in corners):  # a ragged grid: the nearest measured point
            return min(pts, key=lambda p: abs(math.log(p[0] / head_dim)) + abs(math.log(p[1] / seq_len)))[2]
        lg = {c: math.log(table[c]) for c in corners}
        low = lg[(d0, s0)] * (1 - fd) + lg[(d1, s0)] * fd
        high = lg[(d0, s1)] * (1 - fd) + lg[(d1, s1)] * fd
        return math.exp(low * (1 - fs) + high * fs)

    def elementwise(self, dtype: str) -> float:
        """Element-wise speed of `dtype` over float32 (see `elementwise_speed`)."""
        if dtype in self.elementwise_speed:
            return self.elementwise_speed[dtype]
        return {"float32": 1.0, "float8": 4.0}.get(dtype, 2.0)


@dataclass(frozen=True)
class Link:
    """A class of link: bandwidth per device (one direction) and latency per message."""

    kind: str
    """'nvlink', 'xgmi', 'pcie', 'shm' (intra-node) or 'ib', 'roce', 'ethernet' (inter-node)."""
    bandwidth: float
    """Bytes/s per device, one direction."""
    latency: float
    """Seconds per message (the alpha of an alpha-beta model)."""
    efficiency: float = 0.8
    """Achievable fraction of `bandwidth` for large collectives (bus bandwidth / line rate)."""
    p2p_latency: float = 0.0
    """Seconds per point-to-point message when it differs from a collective's ring step (a send
    waits for one peer, a ring step for all of them); 0 = `latency`. Measured by the probe."""
    unit_gather_s: float = 0.0
    """Fixed seconds of one FSDP unit's parameter all-gather as FSDP2 issues it over this link
    (hooks, copy-in and copy-out, the collective's latency and wait), for an FSDP axis of any size
    inside the node (mostly host work); 0 = unmeasured (the ring latency). Measured by the probe
    (`dtorch.cluster.probe.measure_fsdp_units`)."""
    unit_reduce_s: float = 0.0
    """The same for one FSDP unit's gradient reduce-scatter (the post-backward hook included)."""
    unit_gather_s_per_byte: float = 0.0
    """Seconds per byte of an FSDP unit's gathered parameters on top of `unit_gather_s`, as FSDP2
    moves them on this link (0 = unmeasured: the ring fit's bandwidth)."""
    unit_reduce_s_per_byte: float = 0.0
    """The same per byte of a unit's gradients for its reduce-scatter."""
    func_latency_s: float = 0.0
    """Fixed seconds of one functional collective to its wait over this link (CP's K/V exchange,
    TP's DTensor redistributions),
    per ring step; 0 = unmeasured (the ring latency). Measured by the probe
    (`dtorch.cluster.probe.measure_functional_latency`)."""
    a2a_bandwidth: float = 0.0
    """Bytes/s per device of an all-to-all (`all_to_all_single`, a pairwise exchange: each rank sends
    (n-1)/n of its buffer) over this link, as the probe fits it apart from the ring collectives (gloo's
    all-to-all of large messages runs far below its ring); 0 = unmeasured (`bandwidth x efficiency`).
    Measured by the probe (`dtorch.cluster.probe.measure_collectives`)."""
    a2a_latency: float = 0.0
    """Seconds per peer of that all-to-all (its alpha per pairwise step); meaningful only with
    `a2a_bandwidth` set (unmeasured: `latency`)."""
    sync_skew: tuple[tuple[float, ...], ...] = ()
    """(segment s, skew s, group size) rows: what a blocking collective over a group of that many
    ranks of this link costs beyond its own latency and the compute before it, when the ranks arrive
    from `segment` seconds of compute (they drift apart over it where they share cores or a VM lends
    its cores out); group size 0 (a two-column row, as older probes wrote it) = the whole node;
    empty = unmeasured (no such wait). Measured by the probe on CPU ranks
    (`dtorch.cluster.probe.measure_sync_skew`)."""

    def skew(self, segment_s: float, size: int = 0) -> float:
        """Seconds of `sync_skew` after `segment_s` of compute in a group of `size` ranks (0: the
        largest measured): the rows of the largest measured size not above `size` (else the
        smallest), log-log between their segments, proportional below the shortest, held above the
        longest."""
        sizes = sorted({int(p[2]) if len(p) > 2 else 0 for p in self.sync_skew})
        if not sizes or segment_s <= 0:
            return 0.0
        fits = [s for s in sizes if s <= size] if size else sizes
        pick = fits[-1] if fits else sizes[0]
        pts = sorted((p[0], p[1]) for p in self.sync_skew if (int(p[2]) if len(p) > 2 else 0) == pick and p[0] > 0)
        if not pts:
            return 0.0
        if segment_s <= pts[0][0]:
            return pts[0][1] * segment_s / pts[0][0]
        for (s0, k0), (s1, k1) in zip(pts, pts[1:]):
            if segment_s <= s1:
                if k0 <= 0 or k1 <= 0:  # a zero in the curve: linear there
                    return k0 + (k1 - k0) * (segment_s - s0) / (s1 - s0)
                f = math.log(segment_s / s0) / math.log(s1 / s0)
                return math.exp(math.log(k0) * (1 - f) + math.log(k1) * f)
        return pts[-1][1]


@dataclass(frozen=True)
class NodeGroup:
    """`num_nodes` identical nodes, each with `devices_per_node` devices of one type."""

    device: DeviceType
    num_nodes: int
    devices_per_node: int
    intra: Link
    inter: Link
    host_memory_bytes: int = 0
    """CPU memory per node (for offload), bytes; 0 = unknown."""
    host_cores: int = 0
    """CPU cores per node; 0 = unknown. A CPU cluster whose ranks outnumber its cores time-shares
    them: a rank that waits (a pipeline bubble) lends its share to the busy ones."""
    disk_bytes: int = 0
    """Bytes of the local disk the NVMe optimizer tier may fill, per node; 0 = unknown (no check)."""
    disk_read_bytes_per_s: float = 0.0
    """Local disk read bandwidth per node as the NVMe tier reads (direct I/O, no page cache), bytes/s;
    0 = unknown (the cost model's conservative nominal figure). `dtorch probe --disk DIR` measures it
    into the calibration."""
    disk_write_bytes_per_s: float = 0.0
    """Local disk write bandwidth per node as the NVMe tier writes, bytes/s; 0 = unknown (nominal)."""
    disk_read_write_bytes_per_s: float = 0.0
    """Bytes per second the local disk reads, and as many it writes back, with both in flight the
    way the NVMe tier moves its blocks (`dtorch probe --disk`'s cycle); 0 = unknown (the read and
    the write bandwidth one after the other)."""
    host_adam_params_per_s: float = 0.0
    """torch's fused CPU AdamW, parameters per second per rank with every rank of the node stepping
    at once (the host optimizer tier's kernel beside an accelerator); 0 = unknown (a nominal
    figure). Measured by `dtorch probe` (`dtorch.cluster.host`)."""
    host_adam_loop_params_per_s: float = 0.0
    """torch's default CPU AdamW kernel (the per-tensor loop), parameters/s per rank; 0 = unknown."""
    host_link_bytes_per_s: float = 0.0
    """Pinned host <-> device copies, bytes/s per device one way (the slower of the two); on a CPU
    the bytes a host tensor copy moves per second; 0 = unknown (the nominal PCIe figure, on a CPU
    the device's memory bandwidth). Measured by `dtorch probe`."""

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node


@dataclass
class Cluster:
    """Nodes x devices, possibly of several types (one NodeGroup per type)."""

    groups: list[NodeGroup]
    name: str = "cluster"
    calibration: dict = field(default_factory=dict)
    """Measured numbers from `dtorch probe` (merged over presets); free-form, documented in probe.py."""

    @property
    def world_size(self) -> int:
        return sum(g.num_devices for g in self.groups)

    @property
    def num_nodes(self) -> int:
        return sum(g.num_nodes for g in self.groups)

    @property
    def homogeneous(self) -> bool:
        """One kind of device everywhere: every group's device has the same name and the same
        numbers. Same-named devices measured at different speeds (`dtorch probe` writes each as its
        own group) make a mixed cluster, planned per group (docs/heterogeneous.md)."""
        first = self.groups[0].device
        return all(g.device == first for g in self.groups[1:])

    @property
    def devices_per_node(self) -> int:
        """Devices per node; for mixed node sizes the smallest (TP must fit in every node)."""
        return min(g.devices_per_node for g in self.groups)

    # ---- added for the planner (backwards-compatible helpers) ----------------------------------
    def slowest_group(self) -> NodeGroup:
        """The group that bounds a synchronous step: lowest peak FLOP/s, then least memory.

        In a mixed cluster every rank waits for the slowest one, so the cost model plans with it."""
        return min(self.groups, key=lambda g: (max(g.device.peak_flops.values()) * g.device.matmul_efficiency,
                                               g.device.memory_bytes))

    def describe(self) -> str:
        """One line: ``8 nodes x 8 H100-SXM-80GB (64 devices)``."""
        parts = [f"{g.num_nodes} node{'s' if g.num_nodes > 1 else ''} x {g.devices_per_node} {g.device.name}"
                 for g in self.groups]
        return " + ".join(parts) + f" ({self.world_size} devices)"
