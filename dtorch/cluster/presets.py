"""Device and node presets from public spec sheets.

Numbers (dense, no sparsity) and their sources:
- A100 SXM 80GB: 312 TFLOP/s bf16/fp16, 19.5 fp32 (156 tf32), 2.0 TB/s HBM2e, NVLink3 600 GB/s per GPU
  both ways, HDR InfiniBand 200 Gb/s per NIC (NVIDIA A100 datasheet; DGX A100 user guide).
- H100 SXM 80GB: 989 TFLOP/s bf16, 1979 fp8, 67 fp32 (494 tf32), 3.35 TB/s HBM3, NVLink4 900 GB/s per GPU
  both ways, NDR InfiniBand 400 Gb/s per NIC (NVIDIA H100 datasheet; DGX H100).
- H100 96GB (Meta Grand Teton as in torchtitan's Dec 2024 benchmark): the SXM part (132 SMs) with 96 GB
  HBM2e at 2.4 TB/s, run at its default 500 W power limit, 400 Gb/s RDMA per GPU (torchtitan
  benchmarks/llama3_h100_202412_torchtitan.md, whose footnote says its peak lies "between SXM and NVL"
  and is not published). Its peaks are the SXM sheet's at the clock a 500 W cap sustains
  (`power_capped`): 884 TFLOP/s bf16.
- H200 141GB: 989 bf16, 1979 fp8, 4.8 TB/s HBM3e, NVLink4, NDR (NVIDIA H200 datasheet).
- B200: 2.25 PFLOP/s bf16, 4.5 fp8, 180 GB usable per GPU in DGX B200 (1,440 GB / 8), 8 TB/s HBM3e,
  NVLink5 1.8 TB/s per GPU both ways, 400 Gb/s ConnectX-7 per GPU (DGX B200 datasheet).
- MI300X: 1307 TFLOP/s bf16, 2615 fp8, 163 fp32, 192 GB HBM3, 5.3 TB/s, Infinity Fabric 896 GB/s aggregate
  per GPU both ways (7 links x 64 GB/s), 400 Gb/s NIC per GPU (AMD MI300X datasheet; torchtitan peak table).
- CPU: a nominal server socket (`CPU_SOCKET`: 16 cores, 2.5 GHz, AVX2 + FMA), its peak by the rule that
  MFU divides by on every CPU (`dtorch.cluster.peak`); `dtorch.cluster.detect()` reads this machine's instead.

Bandwidths in `Link` are bytes/s per device in one direction; link efficiencies are the usual nccl-tests
bus bandwidth over line rate (about 0.8 on NVLink, 0.85-0.9 on InfiniBand); `dtorch probe` measures them.
"""

from __future__ import annotations

from dtorch.cluster.peak import CpuPeak, cpu_peak
from dtorch.cluster.spec import DeviceType, Link

GB = 10**9
GiB = 2**30

CPU_SOCKET = {"cores": 16, "ghz": 2.5, "flags": frozenset({"avx", "avx2", "fma"})}
"""The `cpu` preset's nominal server socket: 16 physical cores at 2.5 GHz with AVX2 and FMA (two
8-wide fp32 FMA units per core, no 16-bit instructions). Not any real machine, and not this one."""


def cpu_socket_peak(dtype: str) -> CpuPeak:
    """The `cpu` preset's peak FLOP/s in `dtype`: `dtorch.cluster.peak.cpu_peak` over `CPU_SOCKET`,
    the definition MFU uses on a detected CPU, here applied to the nominal socket."""
    return cpu_peak(dtype, flags=set(CPU_SOCKET["flags"]), cores=CPU_SOCKET["cores"], ghz=CPU_SOCKET["ghz"],
                    cpuinfo=[], clock_source="nominal")


_CPU_PEAKS = {d: cpu_socket_peak(d).flops for d in ("float32", "bfloat16", "float16")}


def power_capped(peak_flops: dict[str, float], rated_w: float, limit_w: float) -> dict[str, float]:
    """Dense peaks of a device whose sheet peaks hold at `rated_w`, run under a `limit_w` power cap.

    Dense GEMMs keep a GPU at its power limit, so the limit sets the sustained clock, and the
    peak scales with the clock. CMOS dynamic power is P = a C V^2 f, and across the DVFS range the
    supply voltage rises about linearly with the clock (V ~ f), so P ~ f^3 and the sustained clock
    under a cap scales as (limit / rated)^(1/3) (Hennessy & Patterson, "Computer Architecture",
    ch. 1, power and energy in integrated circuits). Check on one die at two power levels: the
    H100 NVL sheet (132 SMs like the SXM, 400 W) gives 835 TFLOP/s bf16 dense; the rule gives
    989 x (400/700)^(1/3) = 821 from the SXM's 989 at 700 W (-1.7 %). Memory bandwidth is the HBM's
    and does not scale. A limit at or above `rated_w` changes nothing."""
    scale = min(1.0, limit_w / rated_w) ** (1.0 / 3.0)
    return {d: v * scale for d, v in peak_flops.items()}


_H100_SXM_PEAKS = {"bfloat16": 989e12, "float16": 989e12, "float8": 1979e12, "float32": 67e12, "tf32": 494e12}

DEVICES: dict[str, DeviceType] = {
    "a100-80gb": DeviceType(
        name="A100-SXM-80GB",
        peak_flops={"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12, "tf32": 156e12},
        memory_bytes=80 * GiB,
        memory_bandwidth=2.0e12,
        matmul_efficiency=0.7908,  # fitted on every A100 source (dtorch.plan.calibration: fms-fsdp, Korthikanti et al., llm-foundry, Megatron-LM 2021)
    ),
    "h100-sxm": DeviceType(
        name="H100-SXM-80GB",
        peak_flops=dict(_H100_SXM_PEAKS),  # at its 700 W TDP
        memory_bytes=80 * GiB,
        memory_bandwidth=3.35e12,
        matmul_efficiency=0.6642,  # fitted on every H100 SXM source (dtorch.plan.calibration: llm-foundry, Llama 3, Megatron-Bridge)
    ),
    "h100-96gb": DeviceType(
        name="H100-96GB-500W",
        peak_flops=power_capped(_H100_SXM_PEAKS, rated_w=700.0, limit_w=500.0),
        memory_bytes=96 * GB,
        memory_bandwidth=2.4e12,
        matmul_efficiency=0.6408,  # fitted on torchtitan's two 500 W sources over the capped peak (dtorch.plan.calibration)
    ),
    "h200": DeviceType(
        name="H200-141GB",
        peak_flops={"bfloat16": 989e12, "float16": 989e12, "float8": 1979e12, "float32": 67e12, "tf32": 494e12},
        memory_bytes=141 * GB,
        memory_bandwidth=4.8e12,
        matmul_efficiency=0.7401,  # fitted on torchtitan-h200-2025-06 (dtorch.plan.calibration; 2 rows)
    ),
    "b200": DeviceType(
        name="B200-180GB",
        peak_flops={"bfloat16": 2.25e15, "float16": 2.25e15, "float8": 4.5e15, "float32": 75e12, "tf32": 1.1e15},
        memory_bytes=180 * GB,
        memory_bandwidth=8.0e12,
        matmul_efficiency=0.5938,  # fitted on Megatron-Bridge 25.11's B200 rows (dtorch.plan.calibration; 2 rows)
    ),
    "mi300x": DeviceType(
        name="MI300X-192GB",
        peak_flops={"bfloat16": 1307e12, "float16": 1307e12, "float8": 2615e12, "float32": 163e12},
        memory_bytes=192 * GB,
        memory_bandwidth=5.3e12,
        matmul_efficiency=0.5,
        kind="rocm",
    ),
    "cpu": DeviceType(
        name="CPU",
        # 16 cores x 2.5 GHz x 32 FLOP/cycle (two 8-wide FMA units; 16-bit dtypes computed in float32)
        peak_flops=dict(_CPU_PEAKS),
        memory_bytes=64 * GiB,
        memory_bandwidth=100e9,
        matmul_efficiency=0.5,
        kind="cpu",
        op_overhead_s=5e-6,  # eager PyTorch host time per operator, and DTensor's extra (nominal)
        dtensor_op_overhead_s=10e-6,
        # MFU's denominator apart from the cost model's `peak_flops`: a calibration replaces those with
        # measured rates (a measured rate is no peak), this stays the socket's peak
        mfu_peak_flops=dict(_CPU_PEAKS),
    ),
}

ALIASES: dict[str, str] = {
    "a100": "a100-80gb",
    "a100-sxm": "a100-80gb",
    "a100-sxm-80gb": "a100-80gb",
    "h100": "h100-sxm",
    "h100-80gb": "h100-sxm",
    "h100-sxm-80gb": "h100-sxm",
    "h100-gt": "h100-96gb",
    "h200-141gb": "h200",
    "b200-180gb": "b200",
    "mi300x-192gb": "mi300x",
}

# intra-node link, inter-node link, devices per node, host memory per node
NODE_DEFAULTS: dict[str, tuple[Link, Link, int, int]] = {
    "a100-80gb": (Link("nvlink", 300e9, 2e-6, 0.78), Link("ib", 25e9, 5e-6, 0.85), 8, 1024 * GiB),
    "h100-sxm": (Link("nvlink", 450e9, 2e-6, 0.8), Link("ib", 50e9, 5e-6, 0.85), 8, 2048 * GiB),
    "h100-96gb": (Link("nvlink", 450e9, 2e-6, 0.8), Link("roce", 50e9, 5e-6, 0.8), 8, 2048 * GiB),
    "h200": (Link("nvlink", 450e9, 2e-6, 0.8), Link("ib", 50e9, 5e-6, 0.85), 8, 2048 * GiB),
    "b200": (Link("nvlink", 900e9, 2e-6, 0.8), Link("ib", 50e9, 5e-6, 0.85), 8, 2048 * GiB),
    "mi300x": (Link("xgmi", 448e9, 3e-6, 0.7), Link("roce", 50e9, 6e-6, 0.8), 8, 2048 * GiB),
    # gloo between processes of one host: ~0.1-1 ms per ring step and 1-2 GB/s measured on a
    # 2-core VM (`dtorch probe` replaces these); a send/receive pair about 0.1 ms
    "cpu": (Link("shm", 2e9, 2e-4, 1.0, p2p_latency=1e-4), Link("ethernet", 1.25e9, 50e-6, 0.7), 1, 64 * GiB),
}


def preset_names() -> list[str]:
    """Canonical device preset names (aliases are accepted too)."""
    return sorted(DEVICES)


def canonical(name: str) -> str | None:
    """The canonical preset name for `name` (case-insensitive, aliases resolved), or None."""
    key = name.strip().lower().replace("_", "-")
    key = ALIASES.get(key, key)
    return key if key in DEVICES else None
