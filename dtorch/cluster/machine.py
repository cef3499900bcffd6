"""This machine as a cluster: `detect()` (its CUDA/ROCm devices, else its CPU) and `cpu_device()`.

A leaf of `dtorch.cluster` below `load` and `local`: both build on it, it builds on neither.
"""

from __future__ import annotations

import dataclasses
import os

from dtorch.cluster.presets import DEVICES, NODE_DEFAULTS
from dtorch.cluster.spec import Cluster, DeviceType, Link, NodeGroup


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


def detect() -> Cluster:
    """This machine as a one-node cluster: its CUDA/ROCm devices if there are any, else its CPU.

    Torch is imported only when a GPU device node exists, so the CPU path stays fast. The CPU's
    FLOP/s is nominal (cores x clock x 32 FLOP/cycle for two 8-wide fp32 FMA units); `dtorch probe`
    measures the real number."""
    host = _host_memory()
    if os.path.exists("/dev/nvidia0") or os.path.exists("/dev/kfd"):
        try:
            import torch

            if torch.cuda.is_available() and torch.cuda.device_count() > 0:
                n = torch.cuda.device_count()
                prop = torch.cuda.get_device_properties(0)
                name = prop.name
                key = next((k for k, tag in (("h200", "H200"), ("b200", "B200"), ("mi300x", "MI300X"),
                                             ("h100-sxm", "H100"), ("a100-80gb", "A100")) if tag in name), None)
                if key is not None:
                    base = DEVICES[key]
                    dev = dataclasses.replace(base, name=name, memory_bytes=int(prop.total_memory))
                    intra, inter, _, _ = NODE_DEFAULTS[key]
                else:
                    # unknown GPU: SM count x a nominal 1 TFLOP/s per SM for bf16, refine with `dtorch probe`
                    dev = DeviceType(name=name, peak_flops={"bfloat16": prop.multi_processor_count * 1e12},
                                     memory_bytes=int(prop.total_memory), memory_bandwidth=1e12)
                    intra, inter = Link("pcie", 25e9, 5e-6, 0.7), Link("ethernet", 12.5e9, 20e-6, 0.7)
                kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
                dev = dataclasses.replace(dev, kind=kind)
                return Cluster([NodeGroup(dev, 1, n, intra, inter, host)], name=f"local:{n}x{name}")
        except Exception:  # noqa: BLE001 - a broken driver means "no GPU here", fall back to the CPU
            pass
    return Cluster([NodeGroup(cpu_device(), 1, 1, *NODE_DEFAULTS["cpu"][:2], host)], name="local-cpu")


def cpu_device(threads: int | None = None, *, measure: bool = False,
               workload: tuple[int, int, int] | None = None) -> DeviceType:
    """This machine's CPU as one device. FLOP/s in float32 is nominal (cores x clock x 32 FLOP/cycle
    for two 8-wide fp32 FMA units); each other dtype runs at float32's pace times its speed on this
    CPU, arithmetic and element-wise work alike: the flags say whether bfloat16/float16 are native or
    emulated, and with `measure` a transformer block of `workload`'s shape (hidden, heads, seq) is
    timed per dtype on `threads` threads (see `dtorch.cluster.capability`). `dtorch probe` measures
    the real curve."""
    from dtorch.cluster.capability import DEFAULT_WORKLOAD, cpu_speeds, speed_scale
    from dtorch.cluster.peak import cpu_clock_ghz, cpu_peaks

    cores = os.cpu_count() or 1
    flops, bandwidth, eff = cores * cpu_clock_ghz()[0] * 1e9 * 32, 20e9, 0.5
    threads = threads or cores
    speeds, _ = cpu_speeds(threads, measure=measure, workload=workload)
    block_s = speeds.pop("float32_block_s", None)
    if block_s:
        # the nominal clock x FLOP/cycle says nothing of AVX-512 or of PyTorch's kernels at this shape:
        # scale FLOP/s and bandwidth alike so that the timed block costs what it measurably did
        share = threads / cores
        k = speed_scale(block_s, workload or DEFAULT_WORKLOAD, flops * share, eff, bandwidth * share)
        flops, bandwidth = flops * k, bandwidth * k
    return DeviceType(
        name=f"CPU-{cores}core",
        peak_flops={d: flops * r for d, r in speeds.items()},
        memory_bytes=_host_memory(),
        memory_bandwidth=bandwidth,
        matmul_efficiency=eff,
        kind="cpu",
        # eager PyTorch on a CPU: ~4-9 us of host time per operator, ~10-20 us more on DTensors
        # (measured by `dtorch probe`, which replaces these nominal values)
        op_overhead_s=5e-6,
        dtensor_op_overhead_s=10e-6,
        elementwise_speed=dict(speeds),
        # MFU's denominator: the theoretical peak from the CPU's features, not the scaled figure above
        mfu_peak_flops=cpu_peaks(tuple(speeds)),
    )
