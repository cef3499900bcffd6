"""`dtorch probe`: measure the cluster a job runs on and store a calibration the planner uses.

What is measured, on every rank at once (on a CPU machine the ranks share the cores, so each rank's
numbers are what it gets under the real concurrency of a job of that many ranks):

- GEMM throughput by shape and dtype, ``[rows x k] @ [k x width]``, an efficiency curve;
- the attention kernel (causal SDPA forward + backward) by head_dim, sequence length and dtype: it
  runs at its own speed, on a CPU several times below the GEMMs';
- memory bandwidth (a large tensor copy, bytes read + written per second);
- collectives by message size for each link class present - all-reduce, all-gather,
  reduce-scatter over the ranks of one node (``intra``) and over one rank per node (``inter``),
  and point-to-point ping-pong between pairs of ranks;
- all-to-all (``all_to_all_single`` into a fresh output, as expert parallelism's token dispatch
  runs it) at the same message sizes and two larger ones, fitted apart into the link's
  ``a2a_bandwidth`` / ``a2a_latency`` (on gloo a dispatch buffer of tens of MiB goes well below the
  ring collectives' fit, so one fit would misprice both).

The calibration document (JSON; written atomically; one per cluster name)::

    version: 1
    cluster: local:1x4            # the name `local_cluster(world)` / `load_cluster("detect")` gives
    world_size, local_world_size, backend, device_kind, num_threads, torch, host, created
    device:                       # replaces the preset's numbers (per rank)
      name, peak_flops: {float32: ..., bfloat16: ...}, matmul_efficiency, memory_bandwidth
    links:                        # per link class present, the alpha-beta fit of all collectives
      intra: {kind, bandwidth (bytes/s), latency (s per ring step), p2p_latency (s), efficiency: 1.0,
              unit_gather_s, unit_reduce_s, unit_gather_s_per_byte, unit_reduce_s_per_byte (s per
              FSDP unit and per byte of it, `measure_fsdp_units`),
              func_latency_s (fixed s of a functional collective per ring step, `measure_functional_latency`),
              sync_skew ([[segment s, s a blocking collective costs beyond its latency, group size],
              ...] after that much compute, `measure_sync_skew`; CPU ranks)}
      inter: {...}
    gemm: [{dtype, rows, width, k, flops}]       # the raw curve
    attention: [{dtype, head_dim, seq, batch, heads, flops}]  # the attention kernel (`measure_attention`)
    memory_bandwidth: {per_rank_bytes_per_s}
    dispatch_overhead_s           # seconds per near-empty op (framework cost per kernel)
    op_overhead_s                 # host seconds per op of an eager training step (tiny shapes)
    dtensor_op_overhead_s         # extra host seconds per op on DTensors
    collectives: {intra: {all_reduce: [{bytes, seconds, busbw}], ...}, ...}
    feedback: {...}               # written by dtorch.monitor.feedback: measured/predicted corrections

How the cost model (`dtorch.plan.cost`) takes it: compute time = FLOPs / (peak x efficiency x
shape factor (width, rows)); the probe fits `peak_flops` and `matmul_efficiency` so that
peak x efficiency x shape factor matches the measured curve (least squares in log space, efficiency
at most 1). The shape factor was fitted on GPUs; a CPU's curve is flatter, so there the fitted
`peak_flops` is an effective scale above the best GEMM a rank achieved, which is stored apart as
`measured_peak_flops` (what a rank achieved; MFU divides by the detected peak, `dtorch.cluster.peak`). Collectives are alpha-beta per link class with `bandwidth x efficiency` and
`latency` per ring step: the probe fits both on the measured ring collectives of a link class
together, point-to-point latency apart, and stores them with efficiency 1 (they are achieved, not
line-rate, numbers).

The calibration file itself (where it lives, how it is read, written and applied) is
`dtorch.cluster.calibration_store`, torch-free: it runs inside `load_cluster`, which `dtorch plan`
calls and which must start fast. This module's measurement functions import torch when called.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dtorch import env
from dtorch.cluster.calibration_store import (  # noqa: F401  (the store, re-exported: its old home)
    CALIBRATION_VERSION,
    ENV_DIR,
    ENV_DISABLE,
    apply_calibration,
    calibration_dir,
    calibration_path,
    read_calibration,
    stored_calibration,
    validate_calibration,
    with_stored_calibration,
    write_calibration,
)
from dtorch.cluster.shape import shape_factor as _shape_factor
from dtorch.cluster.timing import timeit
from dtorch.errors import ConfigError
from dtorch.process_group import leave

GEMM_ROWS = (128, 512, 2048)
GEMM_WIDTHS = (32, 128, 512)
GEMM_K = 512
ATTN_HEAD_DIMS = (16, 64, 128)
ATTN_SEQS = (128, 512)  # a GPU's are x8 (`probe_in_group`)
ATTN_ELEMENTS = 2**16  # per operand of one attention call (a GPU's: x256)
COLL_SIZES = tuple(4 ** i * 1024 for i in range(1, 7))  # 4 KiB .. 4 MiB
COLL_OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p", "all_to_all")


# ---- fits (pure) -----------------------------------------------------------------------------------
def collective_steps(op: str, n: int) -> tuple[float, float]:
    """(bytes moved per rank per byte of the full array, latency steps) of a ring collective of n
    ranks, as the cost model counts them: all-gather / reduce-scatter (n-1)/n and n-1 steps,
    all-reduce twice that, point-to-point 1 and 1, all-to-all (a pairwise exchange: each rank keeps
    its own 1/n) (n-1)/n and n-1."""
    if op == "p2p":
        return 1.0, 1.0
    if op == "all_to_all":
        return (n - 1) / n, float(n - 1)
    f = 2.0 if op == "all_reduce" else 1.0
    return f * (n - 1) / n, f * (n - 1)


def fit_alpha_beta(points: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Least-squares fit of ``seconds = alpha x steps + bytes_moved / beta`` on (steps, bytes_moved,
    seconds) points, relative errors weighted equally. Returns (alpha seconds, beta bytes/s), both
    positive (alpha may be 0 when latency is below the noise)."""
    if not points:
        raise ValueError("no points to fit")
    # weighted normal equations for t = a*s + b*m with weights 1/t^2
    saa = sab = sbb = sat = sbt = 0.0
    for s, m, t in points:
        w = 1.0 / max(t, 1e-12) ** 2
        saa += w * s * s
        sab += w * s * m
        sbb += w * m * m
        sat += w * s * t
        sbt += w * m * t
    det = saa * sbb - sab * sab
    a = b = -1.0
    if det > 0:
        a = (sat * sbb - sbt * sab) / det
        b = (saa * sbt - sab * sat) / det
    if a < 0 or b <= 0:
        # latency below the noise: fit bandwidth alone through the origin, then no alpha
        b = sbt / sbb if sbb > 0 else 0.0
        a = 0.0
        if b <= 0:
            b = max(m / t for _, m, t in points)
            return 0.0, b
        return 0.0, 1.0 / b
    return a, 1.0 / b


def fit_gemm_efficiency(records: Sequence[dict], shape_factor: Callable[[float, float], float] | None = None,
                        dtype: str = "float32") -> tuple[float, float]:
    """(peak FLOP/s, base efficiency) such that ``peak x eff x shape_factor(width, rows)`` matches the
    measured GEMM curve of `dtype` best (least squares in log space). Peak is the best measured
    throughput; eff is capped at 1 (then peak is raised to the fitted scale)."""
    if shape_factor is None:
        shape_factor = _shape_factor  # the device model the planner predicts with (dtorch.cluster.shape)
    rs = [r for r in records if r["dtype"] == dtype and r["flops"] > 0]
    if not rs:
        raise ValueError(f"no GEMM measurements for {dtype}")
    peak = max(r["flops"] for r in rs)
    logs = [math.log(r["flops"] / (peak * shape_factor(r["width"], r["rows"]))) for r in rs]
    eff = math.exp(sum(logs) / len(logs))
    if eff > 1.0:
        peak *= eff
        eff = 1.0
    return peak, eff


# ---- measurement (torch, inside a process group or single-process) ----------------------------------
def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _timeit_collective(fn: Callable[[], Any], device, group, *, min_time: float, max_reps: int,
                       blocks: int = 3) -> float:
    """Like `timeit` for a collective. Every rank of `group` must run it the same number of times
    (a rank that stops early deadlocks the rest), so the count is agreed on first: the largest any
    rank asks for after timing one warm call."""
    import torch
    import torch.distributed as dist

    def agree(reps: int) -> int:
        n = torch.tensor([reps], dtype=torch.int64, device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
        return int(n.item())

    return timeit(fn, device, min_time=min_time, max_reps=max_reps, blocks=blocks, agree=agree)


def measure_gemm(device, dtypes: Sequence[str], rows: Sequence[int] = GEMM_ROWS,
                 widths: Sequence[int] = GEMM_WIDTHS, k: int = GEMM_K, min_time: float = 0.05) -> list[dict]:
    """FLOP/s of ``[rows x k] @ [k x width]`` per dtype and shape; every rank runs the same shape at
    the same time (a barrier before each), so the numbers hold under the job's concurrency."""
    import torch

    out = []
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        for r in rows:
            for w in widths:
                a = torch.randn(r, k, device=device).to(dt)
                b = torch.randn(k, w, device=device).to(dt)
                _barrier()
                sec = timeit(lambda a=a, b=b: a @ b, device, min_time=min_time, blocks=5)
                out.append({"dtype": dtype, "rows": r, "width": w, "k": k, "flops": 2.0 * r * w * k / sec})
    return out


def measure_attention(device, dtypes: Sequence[str], head_dims: Sequence[int] = ATTN_HEAD_DIMS,
                      seqs: Sequence[int] = ATTN_SEQS, elements: int = ATTN_ELEMENTS,
                      min_time: float = 0.03) -> list[dict]:
    """FLOP/s of the attention kernel as a training step runs it: causal
    `scaled_dot_product_attention` forward + backward of [batch, heads, seq, head_dim] q, k, v, per
    dtype and shape, its FLOPs counted over the full s x s scores (3 x 4 b h s^2 d, the cost model's
    convention, so the causal kernel's skipped half shows as speed). Every rank runs the same shape at
    the same time (a barrier before each). Each call holds about `elements` elements per operand,
    whatever the shape, so a shape's number is the kernel's, not the call overhead's."""
    import torch
    import torch.nn.functional as F

    out = []
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        for d in head_dims:
            for s in seqs:
                heads = 4
                b = max(1, elements // (heads * s * d))
                q, k, v = (torch.randn(b, heads, s, d, device=device).to(dt).requires_grad_() for _ in range(3))

                def fwd_bwd(q=q, k=k, v=v):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

                _barrier()
                sec = timeit(fwd_bwd, device, min_time=min_time, blocks=3)
                out.append({"dtype": dtype, "head_dim": d, "seq": s, "batch": b, "heads": heads,
                            "flops": 3 * 4.0 * b * heads * s * s * d / sec})
    return out


def measure_memory_bandwidth(device, nbytes: int = 64 * 2**20, min_time: float = 0.2) -> dict:
    """Bytes/s of a tensor copy (each byte read once and written once)."""
    import torch

    n = nbytes // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    _barrier()
    sec = timeit(lambda: dst.copy_(src), device, min_time=min_time)
    return {"bytes": 2 * n * 4, "seconds": sec, "bytes_per_s": 2 * n * 4 / sec}


def measure_dispatch_overhead(device, min_time: float = 0.05) -> float:
    """Seconds per dispatched op that does (almost) no work: the framework's fixed cost per op."""
    import torch

    x = torch.ones(8, device=device)
    y = torch.ones(8, device=device)
    _barrier()
    return timeit(lambda: torch.add(x, y), device, min_time=min_time)


def count_ops(fn: Callable[[], Any]) -> int:
    """Aten operators one call of `fn` dispatches (autograd's backward ops included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "aten":
                _Count.n += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        fn()
    return _Count.n


def _tiny_blocks(device, width: int = 32, depth: int = 4):
    """A training step of a few tiny pre-norm residual MLP blocks: the per-op mix of a transformer
    (linears, norms, activations, residuals, autograd) with no arithmetic worth the name."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    blocks = nn.ModuleList(
        nn.Sequential(nn.RMSNorm(width), nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        for _ in range(depth)).to(device)
    x = torch.randn(2, 8, width, device=device)

    def step():
        h = x
        for b in blocks:
            h = h + b(h)
        h.square().mean().backward()
        for p in blocks.parameters():
            p.grad = None

    return step


def measure_op_overhead(device, min_time: float = 0.05) -> float:
    """Seconds of host time per operator of an eager training step (forward, autograd backward,
    Python module calls): what a step of small per-rank shapes pays per op beyond its arithmetic.
    Measured on all ranks at once, so on a shared CPU it includes the ranks' contention."""
    step = _tiny_blocks(device)
    step()
    n = count_ops(step)
    _barrier()
    return timeit(step, device, min_time=min_time) / max(n, 1)


def measure_dtensor_overhead(device, min_time: float = 0.05) -> float:
    """Extra seconds per operator on DTensors over plain tensors (sharding propagation and
    redistribution checks in Python), for a replicated tensor on a mesh over all ranks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return 0.0
    mesh = init_device_mesh(device.type, (world,))
    x = distribute_tensor(torch.ones(8, device=device), mesh, [Replicate()])
    y = distribute_tensor(torch.ones(8, device=device), mesh, [Replicate()])
    plain_x, plain_y = x.to_local(), y.to_local()
    _barrier()
    dt = timeit(lambda: torch.mul(torch.add(x, y), y), device, min_time=min_time) / 2
    plain = timeit(lambda: torch.mul(torch.add(plain_x, plain_y), plain_y), device, min_time=min_time) / 2
    return max(0.0, dt - plain)


def measure_fsdp_units(group, device, quick: bool = False) -> dict[str, float]:
    """Seconds FSDP2 spends per unit and micro-batch over the process group `group`, as
    `fully_shard` issues them on this backend: the parameter all-gather (copy-in, collective,
    copy-out, the pre-forward hook) and the gradient reduce-scatter (the post-backward hook, copies,
    collective), each as a fixed part and a part per byte of the unit. Units of eight bias-free
    linear layers (a transformer block's tensor count) at two widths, 32 (a few KiB: latency and
    host work) and 160 (0.8 MB of float32, a small block's size), 2 and 8 units of each, the
    difference over the 6 extra units less the same difference unsharded: the all-gather from a
    forward under no_grad (one gather per unit), the reduce-scatter from a forward and backward
    without resharding (one gather and one reduce per unit) less the gather.

    On a CPU this cost is paid on the thread that computes (gloo's collectives as FSDP2 drives them
    move bytes several times slower than the bare collectives of `measure_collectives`); the cost
    model prices a CPU's FSDP with it in place of the alpha-beta ring, for an FSDP axis of any size
    inside the node: the fixed part is mostly host work (measured on a 4-rank, 2-core node: a 2-rank
    axis costs what the 4-rank one does), which the ring's step count does not scale."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device.type)

    def build(k: int, width: int, reshard: bool | None) -> nn.Module:
        model = nn.Sequential(*[nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(8)])
                                for _ in range(k)]).to(device)
        if reshard is not None:
            for block in model:
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        return model

    widths = (32, 160)
    calls: dict[tuple[int, int, str, bool], Callable[[], Any]] = {}
    for width in widths:
        x = torch.randn(4, width, device=device)
        for k in (2, 8):
            for sharded in (False, True):
                stepped = build(k, width, False if sharded else None)  # parameters stay gathered into the backward
                forwarded = build(k, width, True if sharded else None)  # each unit gathers and reshards

                def step(model=stepped, x=x):
                    model(x).sum().backward()

                def forward(model=forwarded, x=x):
                    with torch.no_grad():
                        model(x)

                calls[(width, k, "step", sharded)] = step
                calls[(width, k, "fwd", sharded)] = forward
    # the configurations are timed in interleaved rounds (one call of each per round, the order
    # rotating), so that a slow stretch of the machine weighs on all of them alike rather than on the
    # few timed during it: the results are differences of differences and would take all of it
    keys = list(calls)
    for key in keys:
        for _ in range(2):
            calls[key]()
    samples: dict[tuple, list[float]] = {key: [] for key in keys}
    for rnd in range(5 if quick else 15):
        for key in keys[rnd % len(keys):] + keys[:rnd % len(keys)]:
            dist.barrier(group=group)
            t = time.perf_counter()
            calls[key]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples[key].append(time.perf_counter() - t)
    times = {key: sorted(v)[len(v) // 4] for key, v in samples.items()}  # a low quantile: other load only adds time

    def per_unit(width: int) -> tuple[float, float]:
        def extra(what: str) -> float:
            return ((times[(width, 8, what, True)] - times[(width, 2, what, True)])
                    - (times[(width, 8, what, False)] - times[(width, 2, what, False)])) / 6

        gather = max(0.0, extra("fwd"))
        return gather, max(0.0, extra("step") - gather)

    (g0, r0), (g1, r1) = (per_unit(w) for w in widths)
    b0, b1 = (8 * w * w * 4 for w in widths)  # float32 bytes of a unit's parameters (and gradients)
    g_slope, r_slope = max(0.0, (g1 - g0) / (b1 - b0)), max(0.0, (r1 - r0) / (b1 - b0))
    return {"unit_gather_s": max(0.0, g0 - g_slope * b0), "unit_reduce_s": max(0.0, r0 - r_slope * b0),
            "unit_gather_s_per_byte": g_slope, "unit_reduce_s_per_byte": r_slope}


def measure_functional_latency(group, device, quick: bool = False) -> dict[str, float]:
    """Fixed seconds of one functional collective and its wait (`torch.distributed._functional_collectives`,
    what context parallelism's K/V exchange and TP's DTensor redistributions issue): the mean of an
    all-gather, a reduce-scatter and an all-reduce of 4 KiB over `group`, each timed to its
    `wait_tensor`. The cost model uses it as the latency of CP's and TP's collectives on this link
    in place of the ring fit's alpha of the synchronous ones (DTensor's placement logic is priced
    apart, per operator). Returned per ring step (divided by n - 1 for a group of n ranks): an axis
    of another size scales as a ring does."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed._functional_collectives import all_reduce, wait_tensor
    from torch.distributed.device_mesh import DeviceMesh

    # torch 2.13 renamed the tensor forms (the old names warn); older torch has only the old ones
    all_gather_tensor = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    reduce_scatter_tensor = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    mesh = DeviceMesh.from_group(group, device.type)
    n = mesh.size()
    x = torch.ones(1024 // n * n, device=device)
    fns = (lambda: wait_tensor(all_gather_tensor(x[: x.numel() // n], 0, mesh)),
           lambda: wait_tensor(reduce_scatter_tensor(x, "sum", 0, mesh)),
           lambda: wait_tensor(all_reduce(x, "sum", mesh)))
    out = []
    for fn in fns:
        for _ in range(3):
            fn()
        reps = []
        for _ in range(5 if quick else 15):
            dist.barrier(group=group)
            t = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            reps.append(time.perf_counter() - t)
        out.append(sorted(reps)[len(reps) // 4])
    return {"func_latency_s": sum(out) / len(out) / max(1, n - 1)}  # per ring step


SYNC_SEGMENTS_S = (0.5e-3, 2e-3, 8e-3, 24e-3)
"""Stretches of compute between two blocking collectives that `measure_sync_skew` times (a TP
collective follows a fraction of a millisecond of a small model's work, a CP exchange a block's)."""


def measure_sync_skew(groups, device, ring_step_s: float, quick: bool = False) -> dict[str, list[list[float]]]:
    """Seconds a blocking collective costs beyond the compute before it and the fixed latency the
    cost model charges it, when the ranks arrive from a stretch of compute, as TP's and CP's
    collectives inside a block do. `groups`: {group size: this rank's group of that size}, every
    rank of the node in one group of each size at once (consecutive ranks, as TP and CP take them),
    the largest the node; `ring_step_s`: the functional collective's latency per ring step
    (`measure_functional_latency`), which prices (size - 1) steps.

    For each size and segment every rank runs, back to back, `segment` seconds of GEMMs then a
    4 KiB functional all-gather over its group to its wait (the kind's own cost, a reduce-scatter's
    above an all-gather's, is the link fit's, not the skew's); the same GEMMs run without the collectives right before and after, every rank at
    once (the speed the probe's GEMM curve, and so the cost model, prices compute at). The skew is
    the cycle less that segment and less the charged latency, each timed from a barrier to the last
rank's end (the scheduler of a node with fewer cores than ranks runs some ranks first; a step
ends with its slowest). Ranks that share
    cores, or a VM whose cores are lent to neighbours, drift apart over a segment and every
    collective waits for the slowest; a barrier before each timing (as the latency probes do) hides
    exactly that. Timing whole cycles, not the wait alone, also counts what a waiting rank gives
    back where ranks outnumber cores (its core runs a peer's segment), and what a group of one size
    costs that the ring-step latency does not say (measured 1 ms more per collective for pairs of a
    4-rank, 2-core node, about nothing for the node). Returned as
    ``sync_skew: [[segment s, skew s, group size], ...]`` for `SYNC_SEGMENTS_S` and every size; the
    cost model interpolates it (`Link.skew`)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed._functional_collectives import wait_tensor
    from torch.distributed.device_mesh import DeviceMesh

    all_gather_tensor = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    node = groups[max(groups)]
    a, w = torch.randn(128, 128, device=device), torch.randn(128, 128, device=device)
    # a gain above 1 keeps the values of order one however long the loop: a shrinking chain reaches
    # subnormal floats, which some CPUs multiply ~30x slower, and the segment is then not the
    # GEMM time the cost model prices
    gain = 1.5 / 128**0.5

    def work(k: int) -> None:
        y = a
        for _ in range(k):
            y = torch.tanh(y @ w * gain)

    def slowest(v: float) -> float:
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=node)
        return float(t.item())

    # one unit of work, agreed over the node (every rank of a group must run as many collectives)
    unit = torch.tensor([timeit(lambda: work(1), device, min_time=0.01)], dtype=torch.float64)
    dist.all_reduce(unit, op=dist.ReduceOp.MAX, group=node)
    unit_s = float(unit.item())
    out = []
    for size in sorted(groups):
        mesh = DeviceMesh.from_group(groups[size], device.type)
        shard = torch.ones(1024 // size, device=device)

        def op(shard=shard, mesh=mesh):
            return wait_tensor(all_gather_tensor(shard, 0, mesh))

        for _ in range(3):
            op()
        for seg in SYNC_SEGMENTS_S:
            k = max(1, round(seg / unit_s))
            reps = max(6, int((0.1 if quick else 0.4) / (seg + 1e-3))) // 2 * 2

            def run(with_collectives: bool, n: int, k: int = k, op=op) -> float:
                dist.barrier(group=node)
                t0 = time.perf_counter()
                for _ in range(n):
                    work(k)
                    if with_collectives:
                        op()
                return (time.perf_counter() - t0) / n

            before = slowest(run(False, reps // 2))
            cycle = slowest(run(True, reps))
            alone = (before + slowest(run(False, reps // 2))) / 2
            out.append([alone, max(0.0, cycle - alone - (size - 1) * ring_step_s), float(size)])
    return {"sync_skew": out}


def measure_collectives(group, ranks: list[int], device, sizes: Sequence[int] = COLL_SIZES,
                        ops: Sequence[str] = COLL_OPS, min_time: float = 0.05) -> dict[str, list[dict]]:
    """Seconds per collective by message size over the process group `group` (global `ranks`).
    `bytes` is the full array (all-reduce / reduce-scatter input, all-gather output, each rank's
    all-to-all send buffer, split evenly over the group); point-to-point is a ping-pong between rank
    pairs (2i, 2i+1) of the group, half the round trip. The all-to-all also runs at 4x and 8x the
    largest size (16 and 32 MiB by default): expert parallelism's dispatch buffers are tens of MiB,
    where gloo's exchange into a freshly allocated output slows well below its small-message rate."""
    import torch
    import torch.distributed as dist

    n = len(ranks)
    me = dist.get_rank()
    idx = ranks.index(me)
    out: dict[str, list[dict]] = {op: [] for op in ops}
    # torch 2.13 renamed the tensor forms (the old names warn); older torch has only the old ones
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    extra = (4 * sizes[-1], 8 * sizes[-1]) if "all_to_all" in ops and sizes else ()
    for size in (*sizes, *extra):
        numel = max(n, size // 4 // n * n)
        full = torch.ones(numel, device=device)
        shard = torch.ones(numel // n, device=device)
        for op in (ops if size in sizes else ("all_to_all",)):
            if op == "all_reduce":
                def fn(full=full):
                    dist.all_reduce(full, group=group)
            elif op == "all_gather":
                def fn(full=full, shard=shard):
                    all_gather(full, shard, group=group)
            elif op == "reduce_scatter":
                def fn(full=full, shard=shard):
                    reduce_scatter(shard, full, group=group)
            elif op == "all_to_all":
                # as dtorch.parallel.expert issues it: the output allocated per call (at tens of MiB a
                # fresh buffer's first touch inside gloo's receive costs as much as the transfer)
                def fn(full=full):
                    dist.all_to_all_single(torch.empty_like(full), full, group=group)
            else:
                peer_idx = idx ^ 1
                if peer_idx >= n:
                    def fn():
                        return None
                else:
                    peer = ranks[peer_idx]
                    first = idx % 2 == 0

                    def fn(full=full, peer=peer, first=first):
                        if first:
                            dist.send(full, peer)
                            dist.recv(full, peer)
                        else:
                            dist.recv(full, peer)
                            dist.send(full, peer)
            dist.barrier(group=group)
            try:
                # seven short blocks, not three long ones: on a shared CPU a collective's time is
                # bimodal (the peers on cores at once, or waiting for each other's time slice) in
                # stretches of tens of ms, and the median block then stays with the common state
                sec = _timeit_collective(fn, device, group, min_time=min_time, max_reps=50, blocks=7)
            except (RuntimeError, NotImplementedError) as e:  # a backend without this collective
                out[op].append({"bytes": numel * 4, "error": str(e).splitlines()[0][:200]})
                continue
            if op == "p2p":
                sec /= 2.0
            moved, _ = collective_steps(op, n)
            out[op].append({"bytes": numel * 4, "seconds": sec, "busbw": numel * 4 * moved / sec})
    return out


def _link_fit(colls: dict[str, list[dict]], n: int, kind: str) -> dict:
    """The link's alpha-beta from its ring collectives, and point-to-point latency apart: a ring step
    waits for every rank of the group (on an oversubscribed CPU, for each to be scheduled), a
    send for one peer, so one alpha would misprice both. The all-to-all gets its own alpha-beta
    (`a2a_latency` per peer, `a2a_bandwidth` from its largest messages): gloo's pairwise exchange into
    a fresh buffer of tens of MiB runs at a fraction of its rings' rate."""
    points, p2p, a2a = [], [], []
    for op, rows in colls.items():
        moved, steps = collective_steps(op, 2 if op == "p2p" else n)
        bucket = p2p if op == "p2p" else a2a if op == "all_to_all" else points
        for r in rows:
            if "seconds" in r:
                bucket.append((steps, r["bytes"] * moved, r["seconds"]))
    alpha, beta = fit_alpha_beta(points or p2p or a2a)
    out = {"kind": kind, "bandwidth": beta, "latency": alpha, "efficiency": 1.0, "ranks": n}
    if p2p and points:
        out["p2p_latency"] = max(1e-9, fit_alpha_beta(p2p)[0])
    if a2a:
        # the latency from every size, the bandwidth from the three largest with that latency taken
        # off: the dispatch buffers that matter are large, and a fit weighting every size alike
        # would carry the small messages' faster rate up to them
        a2a.sort(key=lambda p: p[1])
        a_lat = fit_alpha_beta(a2a)[0]
        big = a2a[-3:]
        busy = sum(t - a_lat * s for s, _, t in big)
        out["a2a_latency"] = a_lat
        out["a2a_bandwidth"] = sum(m for _, m, _ in big) / busy if busy > 0 else fit_alpha_beta(big)[1]
    return out


HOST_ROUNDS = 3  # rounds of the host-side scalars per probe (`measure_host_round`); --quick: one


def measure_host_round(device, quick: bool, cuda: bool) -> dict:
    """One round of the host-side measurements: memory bandwidth (a 64 MiB copy), the dispatch,
    eager-op and DTensor costs per operator, and the host optimizer (`host.measure_host_optimizer`,
    under "host_opt"). `probe_in_group` takes the median of `HOST_ROUNDS` rounds spread over the probe."""
    from dtorch.cluster.host import measure_host_optimizer

    out = measure_memory_bandwidth(device, (16 if quick else 64) * 2**20, 0.03 if quick else 0.1)
    out["dispatch_s"] = measure_dispatch_overhead(device, 0.01 if quick else 0.03)
    out["op_s"] = measure_op_overhead(device, 0.03 if quick else 0.1)
    out["dtensor_s"] = measure_dtensor_overhead(device, 0.02 if quick else 0.05)
    out["host_opt"] = measure_host_optimizer((1 if quick else 4) * 2**20, 0.03 if quick else 0.1,
                                             device if cuda else None)
    return out


def probe_in_group(*, quick: bool = False, local_world_size: int | None = None,
                   dtypes: Sequence[str] | None = None) -> dict | None:
    """Run every measurement on all ranks of the current job at once; returns the calibration
    document on global rank 0 and None elsewhere. Works single-process (no collectives) too."""
    import torch
    import torch.distributed as dist

    distributed = dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    e = env.current()
    local = int(local_world_size or e.local_world_size or world)
    cuda = torch.cuda.is_available()
    local_rank = e.local_rank if e.local_rank is not None else rank % local
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtypes = list(dtypes or (("float32", "bfloat16") if not cuda else ("bfloat16", "float32")))
    t0 = time.perf_counter()
    mine = _measure_rank(device, dtypes, quick=quick, cuda=cuda, rank=rank, world=world, local=local,
                         distributed=distributed)
    gathered = [None] * world
    if distributed and world > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if rank != 0:
        return None
    backend = dist.get_backend() if distributed else ("nccl" if cuda else "gloo")
    return _calibration_document(gathered, dtypes, cuda=cuda, world=world, local=local, backend=backend,
                                 seconds=time.perf_counter() - t0)


def _measure_rank(device, dtypes: list[str], *, quick: bool, cuda: bool, rank: int, world: int, local: int,
                  distributed: bool) -> dict:
    """This rank's measurements: GEMMs, attention, the links (all ranks at once) and the host-side
    scalars in rounds; gathered on rank 0 by `probe_in_group`."""
    rows = GEMM_ROWS[::2] if quick else GEMM_ROWS
    widths = GEMM_WIDTHS[::2] if quick else GEMM_WIDTHS
    if cuda:  # GPU GEMMs need far larger shapes to approach peak
        rows, widths, k = tuple(4 * r for r in rows), tuple(8 * w for w in widths), 4096
    else:
        k = GEMM_K
    from dtorch.progress import Ticker

    p = Ticker(f"probing {world} rank{'s' if world > 1 else ''}", enabled=None if rank == 0 else False).start()
    p.note = f"GEMMs ({len(dtypes)} dtypes x {len(rows) * len(widths)} shapes)"
    gemm = measure_gemm(device, dtypes, rows, widths, k, min_time=0.01 if quick else 0.03)
    p.note = "attention"
    attention = measure_attention(device, dtypes, ATTN_HEAD_DIMS,
                                  tuple(8 * s for s in ATTN_SEQS) if cuda else ATTN_SEQS,
                                  elements=ATTN_ELEMENTS * (256 if cuda else 1), min_time=0.01 if quick else 0.03)
    # the host-side scalars (memory bandwidth, per-op costs, host optimizer) in rounds spread over the
    # probe, each the median of its rounds: a neighbour's burst of memory traffic or load in one
    # round (seen as 0.5-2x on shared VMs) does not become the calibration
    rounds = [measure_host_round(device, quick, cuda)]
    p.note = "collectives"
    colls: dict[str, dict] = {}
    links: dict[str, dict] = {}
    if distributed and world > 1:
        colls, links = _measure_links(device, rank=rank, world=world, local=local, cuda=cuda, quick=quick,
                                      ticker=p, rounds=rounds)
    p.note = f"host round {len(rounds) + 1}"
    while len(rounds) < (1 if quick else HOST_ROUNDS):
        rounds.append(measure_host_round(device, quick, cuda))
    p.stop()
    membw = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k != "host_opt"}
    host_opt = {k: statistics.median(r["host_opt"][k] for r in rounds) for k in rounds[0]["host_opt"]}
    membw["rounds_bytes_per_s"] = [r["bytes_per_s"] for r in rounds]
    return {"gemm": gemm, "attention": attention, "membw": membw, "colls": colls, "links": links, "host_opt": host_opt,
            "memory_bytes": _usable_memory(device, local)}


def _measure_links(device, *, rank: int, world: int, local: int, cuda: bool, quick: bool, ticker,
                   rounds: list[dict]) -> tuple[dict[str, dict], dict[str, dict]]:
    """(collectives timed, links fitted) within this rank's node and across nodes; every rank of
    the job calls it. A second host round runs between the two on a full probe (`rounds`)."""
    import torch.distributed as dist

    colls: dict[str, dict] = {}
    links: dict[str, dict] = {}
    sizes = COLL_SIZES[::2] if quick else COLL_SIZES
    nodes = world // local
    # every rank must create every group, in the same order
    intra_groups = [list(range(i * local, (i + 1) * local)) for i in range(nodes)]
    inter_groups = [list(range(j, world, local)) for j in range(local)]
    pg_intra = [dist.new_group(r) if len(r) < world else dist.group.WORLD for r in intra_groups]
    pg_inter = [dist.new_group(r) if len(r) < world else dist.group.WORLD for r in inter_groups] if nodes > 1 else []
    # the smaller groups a TP or CP degree forms inside a node (consecutive ranks), for the skew
    sub_groups = {}
    for size in (d for d in range(2, local) if local % d == 0):
        for start in range(0, world, size):
            pg = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                sub_groups[size] = pg
    node, lr = rank // local, rank % local
    backend = dist.get_backend()
    intra_kind = "shm" if not cuda else "nvlink"
    if local > 1:
        colls["intra"] = measure_collectives(pg_intra[node], intra_groups[node], device, sizes,
                                             min_time=0.005 if quick else 0.015)
        links["intra"] = _link_fit(colls["intra"], local, intra_kind)
        ticker.note = "FSDP units"
        links["intra"].update(measure_fsdp_units(pg_intra[node], device, quick))
        links["intra"].update(measure_functional_latency(pg_intra[node], device, quick))
        if not cuda:  # a GPU's kernels run apart from the host's clock: not timed this way
            ticker.note = "skew at collectives"
            links["intra"].update(measure_sync_skew({local: pg_intra[node], **sub_groups}, device,
                                                      links["intra"]["func_latency_s"], quick))
        if not quick:
            ticker.note = "host round 2"
            rounds.append(measure_host_round(device, quick, cuda))
    if nodes > 1:
        colls["inter"] = measure_collectives(pg_inter[lr], inter_groups[lr], device, sizes,
                                             min_time=0.005 if quick else 0.015)
        links["inter"] = _link_fit(colls["inter"], nodes, "ib" if backend == "nccl" else "ethernet")
    return colls, links


def _calibration_document(gathered: list[dict], dtypes: list[str], *, cuda: bool, world: int, local: int,
                          backend: str, seconds: float) -> dict:
    """The calibration document from every rank's measurements (see `validate_calibration`)."""
    import torch

    from dtorch.cluster.local import local_cluster

    # one curve for all ranks: the median over ranks per shape (the minimum would follow whichever
    # rank a neighbour's burst of load hit; on a dedicated machine the ranks agree anyway)
    gemm_all: dict[tuple, list[dict]] = {}
    for res in gathered:
        for r in res["gemm"]:
            gemm_all.setdefault((r["dtype"], r["rows"], r["width"], r["k"]), []).append(r)
    gemm_min = [{**rs[0], "flops": statistics.median(x["flops"] for x in rs),
                 "flops_per_rank": [x["flops"] for x in rs]} for rs in gemm_all.values()]
    attn_all: dict[tuple, list[dict]] = {}
    for res in gathered:
        for r in res["attention"]:
            attn_all.setdefault((r["dtype"], r["head_dim"], r["seq"]), []).append(r)
    attention = [{**rs[0], "flops": statistics.median(x["flops"] for x in rs),
                  "flops_per_rank": [x["flops"] for x in rs]} for rs in attn_all.values()]
    peaks: dict[str, float] = {}
    effs: dict[str, float] = {}
    for dt in dtypes:
        peaks[dt], effs[dt] = fit_gemm_efficiency(gemm_min, dtype=dt)
    main = "float32" if not cuda else "bfloat16"
    mem_bw = statistics.median(res["membw"]["bytes_per_s"] for res in gathered)
    # the links are fitted per rank (each rank times the same collectives): take the median rank's fit
    links_all: dict[str, dict] = {}
    for cls in {c for res in gathered for c in res["links"]}:
        fits = sorted((res["links"][cls] for res in gathered if cls in res["links"]), key=lambda d: d["bandwidth"])
        links_all[cls] = fits[len(fits) // 2]
    cluster = local_cluster(world, local, calibrated=False)
    base_dev = cluster.groups[0].device
    # every dtype's peak is scaled to the main dtype's efficiency so that one matmul_efficiency holds
    peak_flops = {dt: peaks[dt] * effs[dt] / effs[main] for dt in dtypes}
    best = {dt: max(r["flops"] for r in gemm_min if r["dtype"] == dt) for dt in dtypes}
    return validate_calibration({
        "version": CALIBRATION_VERSION,
        "cluster": cluster.name,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "backend": backend,
        "world_size": world,
        "local_world_size": local,
        "device_kind": base_dev.kind,
        "num_threads": torch.get_num_threads(),
        "probe_seconds": round(seconds, 2),
        "device": {
            "name": base_dev.name,
            "device_kind": base_dev.kind,
            "peak_flops": peak_flops,
            "matmul_efficiency": effs[main],
            "memory_bandwidth": mem_bw,
            "measured_peak_flops": best,
            "nominal_peak_flops": dict(base_dev.peak_flops),
        },
        "links": {cls: {k: v for k, v in d.items() if k != "ranks"} for cls, d in links_all.items()},
        "gemm": sorted(gemm_min, key=lambda r: (r["dtype"], r["rows"], r["width"])),
        # the attention kernel's own speed (median rank per shape): DeviceType.attention_flops
        "attention": sorted(attention, key=lambda r: (r["dtype"], r["head_dim"], r["seq"])),
        "memory_bandwidth": {"per_rank_bytes_per_s": [res["membw"]["bytes_per_s"] for res in gathered],
                             "rounds_bytes_per_s": [res["membw"]["rounds_bytes_per_s"] for res in gathered]},
        "dispatch_overhead_s": statistics.median(res["membw"]["dispatch_s"] for res in gathered),
        # host time per op of an eager step and the DTensor surcharge (median rank): the cost model's
        # host-overhead term (DeviceType.op_overhead_s / dtensor_op_overhead_s)
        "op_overhead_s": statistics.median(res["membw"]["op_s"] for res in gathered),
        "dtensor_op_overhead_s": statistics.median(res["membw"]["dtensor_s"] for res in gathered),
        "collectives": gathered[0]["colls"],
        # every rank stepped its AdamW at once (the node's ranks share its cores): the median rank
        "host_optimizer": {k: statistics.median(res["host_opt"][k] for res in gathered)
                           for k in gathered[0]["host_opt"]},
        # each rank's own speed (its median GEMM FLOP/s in the main dtype) and usable memory: ranks
        # of one device name that run at different speeds become groups of their own (hetero.py)
        "ranks": [{"rank": r, "speed_flops": statistics.median(x["flops"] for x in res["gemm"] if x["dtype"] == main),
                   "memory_bytes": res["memory_bytes"]} for r, res in enumerate(gathered)],
    })


def _usable_memory(device, local: int) -> int:
    """Bytes this rank may use: its GPU's total memory, or on a CPU its share of the host's
    available memory (MemAvailable / ranks on the node)."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // max(1, local)
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // max(1, local)


def measured_groups(doc: dict, threshold: float | None = None):
    """The probed cluster with one node group per class of ranks that measured alike
    (`dtorch.cluster.hetero`); a calibration without per-rank figures gives one group."""
    from dtorch.cluster.hetero import SPEED_THRESHOLD, measured_cluster
    from dtorch.cluster.local import local_cluster

    base = apply_calibration(local_cluster(doc["world_size"], doc["local_world_size"], calibrated=False), doc)
    ranks = doc.get("ranks") or []
    if len(ranks) != base.world_size:
        return base
    return measured_cluster(base, [r["speed_flops"] for r in ranks], [r["memory_bytes"] for r in ranks],
                            threshold=SPEED_THRESHOLD if threshold is None else threshold)


def _threads_per_rank(local: int) -> int:
    return max(1, (os.cpu_count() or 1) // local)


def _spawn_entry(rank: int, world: int, rdzv: str, out: str, quick: bool, dtypes) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(_threads_per_rank(world))
    env.export({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{rdzv}", rank=rank, world_size=world)
    try:
        doc = probe_in_group(quick=quick, local_world_size=world, dtypes=dtypes)
        if doc is not None:
            Path(out).write_text(json.dumps(doc))
        # every rank leaves together: a rank whose peer tore its gloo pairs down first could abort
        # in the C++ teardown ("terminate called without an active exception", seen 1 in 4 runs)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    leave(0)  # the document is written: skip the finalization that can abort in gloo's teardown


def run_probe(nproc: int | None = None, *, quick: bool = False, out: str | Path | None = None,
              dtypes: Sequence[str] | None = None, save: bool = True) -> tuple[dict, Path | None]:
    """Probe and (when `save`) store the calibration; returns (document, path written).

    Inside a launched job (RANK/WORLD_SIZE in the environment: `dtorch run`, torchrun) every rank
    must call this; it joins the job's process group and measures there (`nproc` is ignored).
    Otherwise `nproc` processes are spawned on this machine (default: the workers `dtorch train` starts, its GPU
    count or 2 on a CPU machine), each with its share of the cores. The file goes to `out` or
    `calibration_path(cluster name)`; other ranks return ({}, None)."""
    import torch
    import torch.distributed as dist

    e = env.current()
    if e.rank is not None and e.world_size is not None and e.world_size > 1:
        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        doc = probe_in_group(quick=quick, dtypes=dtypes)
        if doc is None:
            return {}, None
    else:
        from dtorch.cluster.local import default_workers

        n = nproc or default_workers()
        if n < 1:
            raise ConfigError("nproc", n, "give at least 1 process")
        if torch.cuda.is_available() and n > torch.cuda.device_count():
            raise ConfigError("nproc", n, f"this machine has {torch.cuda.device_count()} GPUs")
        if n == 1:
            prev = torch.get_num_threads()
            torch.set_num_threads(_threads_per_rank(1))
            try:
                doc = probe_in_group(quick=quick, local_world_size=1, dtypes=dtypes)
            finally:
                torch.set_num_threads(prev)
            assert doc is not None
        else:
            import torch.multiprocessing as mp

            with tempfile.TemporaryDirectory() as tmp:
                res = os.path.join(tmp, "calibration.json")
                mp.spawn(_spawn_entry, args=(n, os.path.join(tmp, "rdzv"), res, quick, dtypes), nprocs=n, join=True)
                doc = json.loads(Path(res).read_text())
    path = None
    if save:
        path = write_calibration(doc, out or calibration_path(doc["cluster"]))
    return doc, path


def summary(doc: dict) -> str:
    """A few human lines: per-rank peak and efficiency, memory bandwidth, links."""
    dev = doc["device"]
    lines = [f"calibration for {doc['cluster']} ({doc['world_size']} ranks, {doc['backend']}, "
             f"{doc.get('num_threads', '?')} threads/rank, probe {doc.get('probe_seconds', '?')} s)"]
    for dt, v in dev["peak_flops"].items():
        best = dev.get("measured_peak_flops", {}).get(dt, v)
        lines.append(f"  GEMM {dt:9s} best {best / 1e9:8.1f} GFLOP/s per rank; cost-model scale {v / 1e9:.1f} GFLOP/s "
                     f"x efficiency {dev['matmul_efficiency']:.2f} x shape factor")
    attn: dict[str, list[dict]] = {}
    for r in doc.get("attention") or []:
        attn.setdefault(r["dtype"], []).append(r)
    for dt, rows in attn.items():
        lines.append(f"  attention {dt:9s} (causal SDPA fwd+bwd, full s^2 counted) " + ", ".join(
            f"d{r['head_dim']}/s{r['seq']} {r['flops'] / 1e9:.1f}" for r in rows) + " GFLOP/s per rank")
    lines.append(f"  memory bandwidth {dev['memory_bandwidth'] / 1e9:.2f} GB/s per rank")
    if "dispatch_overhead_s" in doc:
        lines.append(f"  dispatch overhead {doc['dispatch_overhead_s'] * 1e6:.1f} us per op")
    if "host_optimizer" in doc:
        from dtorch.cluster.host import summary as host_summary

        lines.append("  " + host_summary(doc["host_optimizer"]) + " per rank")
    if "op_overhead_s" in doc:
        lines.append(f"  eager step {doc['op_overhead_s'] * 1e6:.1f} us per op, DTensor surcharge "
                     f"{doc.get('dtensor_op_overhead_s', 0.0) * 1e6:.1f} us per op")
    for cls, link in doc.get("links", {}).items():
        p2p = f", point-to-point {link['p2p_latency'] * 1e6:.1f} us" if link.get("p2p_latency") else ""
        lines.append(f"  {cls:5s} link {link['bandwidth'] / 1e9:.3f} GB/s, latency {link['latency'] * 1e6:.1f} us "
                     f"per step{p2p}")
        if link.get("a2a_bandwidth"):
            lines.append(f"  {cls:5s} all-to-all (EP dispatch) {link['a2a_bandwidth'] / 1e9:.3f} GB/s, latency "
                         f"{link.get('a2a_latency', 0.0) * 1e6:.1f} us per peer")
        if link.get("unit_gather_s") or link.get("unit_reduce_s"):
            lines.append(f"  {cls:5s} FSDP unit: all-gather {link.get('unit_gather_s', 0.0) * 1e6:.0f} us + "
                         f"{link.get('unit_gather_s_per_byte', 0.0) * 1e12:.0f} us/MB, reduce-scatter "
                         f"{link.get('unit_reduce_s', 0.0) * 1e6:.0f} us + {link.get('unit_reduce_s_per_byte', 0.0) * 1e12:.0f} "
                         f"us/MB, per unit")
        if link.get("func_latency_s"):
            lines.append(f"  {cls:5s} functional collective (TP, CP) {link['func_latency_s'] * 1e6:.0f} us fixed per ring step")
        if link.get("sync_skew"):
            for size in sorted({int(r[2]) if len(r) > 2 else 0 for r in link["sync_skew"]}):
                rows = [r for r in link["sync_skew"] if (int(r[2]) if len(r) > 2 else 0) == size]
                lines.append(f"  {cls:5s} skew at a blocking collective after compute"
                             + (f" (groups of {size})" if size else "") + ": " + ", ".join(
                                 f"{r[1] * 1e6:.0f} us after {r[0] * 1e3:.1f} ms" for r in rows))
    if len(doc.get("ranks") or []) > 1:
        speeds = [r["speed_flops"] for r in doc["ranks"]]
        lines.append("  per rank GEMM " + ", ".join(f"{s / 1e9:.1f}" for s in speeds) + " GFLOP/s (slowest/fastest "
                     f"{min(speeds) / max(speeds):.2f})")
    for cls, colls in doc.get("collectives", {}).items():
        for op, rows in colls.items():
            ok = [r for r in rows if "seconds" in r]
            if ok:
                big = ok[-1]
                lines.append(f"  {cls:5s} {op:14s} {ok[0]['bytes'] / 1024:.0f} KiB {ok[0]['seconds'] * 1e6:8.0f} us"
                             f" .. {big['bytes'] / 2**20:.0f} MiB {big['seconds'] * 1e3:7.2f} ms"
                             f" (busbw {big['busbw'] / 1e9:.2f} GB/s)")
    return "\n".join(lines)


if __name__ == "__main__":
    # `dtorch run --nproc-per-node N -m dtorch.cluster.probe [--quick]`: every rank of a launched job probes
    import sys

    from dtorch.cli import main

    sys.exit(main(["probe", *sys.argv[1:]]))
