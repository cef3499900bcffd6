"""The peak FLOP/s that MFU divides by: a GPU's spec sheet, a CPU's detected from its features.

MFU has one definition in DTorch (the plan, the console line, metrics.jsonl, the live page,
Prometheus and the report all use it):

    MFU = model FLOPs per token x tokens/s / (peak FLOP/s of one device in the compute dtype x devices)

Model FLOPs per token are the planner's analytic count, 6 N_matmul + 12 l h s: the matmul
parameters' forward and backward plus attention over the full s x s scores, without the FLOPs that
activation recomputation repeats (the Megatron / PaLM convention, `ModelProfile.flops_per_token`).
The compute dtype is the plan's `param_dtype` (bfloat16 for float8 plans).

On a CPU no spec sheet exists, and a measured GEMM rate is not a peak (MFU against it reached
91-104 %). `cpu_peak` derives the theoretical one from what the kernel reports:

    peak = physical cores x clock x FLOP per cycle per core (dtype)

- cores: distinct (physical id, core id) pairs among the CPUs of the node's container (its cgroup
  CPU set; all of them outside one); hyper-threads share a core's vector units, so they do not count
  twice;
- clock: the highest the cores may run at: ``cpufreq/cpuinfo_max_freq`` where the kernel exposes
  it (the turbo clock), else the ``@ 2.60GHz`` of the model name, else the highest ``cpu MHz``
  (a VM reports its nominal clock there);
- FLOP per cycle: vector lanes x 2 (a fused multiply-add) x 2 FMA units (as on Xeon Gold/Platinum
  and later, and on AMD Zen), by the widest instructions the flags name for that dtype:

  | dtype    | flag                       | FLOP/cycle/core                                     |
  |----------|----------------------------|-----------------------------------------------------|
  | float32  | avx512f                    | 64 (16 lanes; 32 on AMD Zen 4: 256-bit datapaths)   |
  | float32  | avx2 + fma                 | 32                                                  |
  | float32  | avx (no fma)               | 16 (one add and one multiply unit, 8 lanes)         |
  | float32  | sse2 / aarch64 asimd       | 8 / 32 (4 x 128-bit FMA, as Neoverse V2)            |
  | bfloat16 | amx_bf16                   | 1024 (AMX tile multiply)                            |
  | bfloat16 | avx512_bf16 (aarch64 bf16) | 2 x float32's (a dot product of bf16 pairs per lane)|
  | float16  | amx_fp16                   | 1024                                                |
  | float16  | avx512_fp16 (asimdhp)      | 2 x float32's                                       |

  A 16-bit dtype without such a flag is computed in float32 (PyTorch converts), so its peak is
  float32's.

The factors are upper bounds (two FMA units, no AVX-512 or AMX clock offset, the turbo clock where
the kernel exposes it), so a CPU's MFU errs low. One exception: without cpufreq the clock is a base
one (the model name's, or a VM's nominal ``cpu MHz``) and the cores may turbo above it (a 512^3 GEMM
on a VM reporting 2.60 GHz ran at 2.75 GHz's worth). The figure and how it was reached: `dtorch plan`
prints it (`CpuPeak.describe`), and docs/monitoring.md ("MFU") documents it.

Torch-free: `dtorch plan` imports it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dtorch.cluster.capability import cpu_flags

_AMX = 1024.0
"""FLOP per cycle per core of an AMX tile multiply in bfloat16/float16 (Intel: 1024 BF16 ops/cycle)."""


def compute_dtype(param_dtype: str) -> str:
    """The dtype MFU is counted in for a plan's `param_dtype`: float8 plans compute and are
    counted in bfloat16 (the cost model's rule, `dtorch.plan.step`)."""
    return "bfloat16" if param_dtype == "float8" else param_dtype


@dataclass(frozen=True)
class CpuPeak:
    """A CPU's peak FLOP/s in one dtype, with the factors it is the product of."""

    dtype: str
    flops: float
    """FLOP/s of all `cores` together."""
    cores: int
    ghz: float
    flops_per_cycle: float
    """Per core."""
    instructions: str
    """What the per-cycle figure comes from ("AVX-512 FMA x 2", "AMX", ...)."""
    clock_source: str
    """Where the clock was read ("cpuinfo_max_freq", "model name", "cpu MHz", "default")."""

    def describe(self) -> str:
        return (f"{self.cores} core{'s' if self.cores != 1 else ''} x {self.ghz:.2f} GHz ({self.clock_source}) x "
                f"{self.flops_per_cycle:g} FLOP/cycle ({self.instructions}) = {self.flops / 1e9:,.1f} GFLOP/s "
                f"{self.dtype}")


def _cpuinfo() -> list[dict[str, str]]:
    """/proc/cpuinfo as one dict per logical CPU (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return []
    out = []
    for block in text.split("\n\n"):
        entry = {}
        for line in block.splitlines():
            if ":" in line:
                k, v = line.split(":", 1)
                entry[k.strip().lower()] = v.strip()
        if entry:
            out.append(entry)
    return out


CPUSET_FILES = ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus")
"""Where a container's CPU set is read (cgroup v2, v1)."""


def parse_cpu_list(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def node_cpus(files: tuple[str, ...] = CPUSET_FILES) -> set[int] | None:
    """The logical CPUs the node's ranks may use: the container's CPU set where one is readable, else
    None (all of them). Not this process's affinity: a launcher that pins each rank to its own cores
    would make one rank's share look like the node."""
    for path in files:
        try:
            with open(path) as f:
                cpus = parse_cpu_list(f.read())
            if cpus:
                return cpus
        except (OSError, ValueError):
            continue
    return None


def physical_cores(cpuinfo: list[dict[str, str]] | None = None, allowed: set[int] | None = None) -> int:
    """Physical cores among the logical CPUs `allowed` (default: `node_cpus()`, else all)."""
    cpuinfo = _cpuinfo() if cpuinfo is None else cpuinfo
    if allowed is None:
        allowed = node_cpus()
    cores = set()
    for i, e in enumerate(cpuinfo):
        cpu = int(e["processor"]) if e.get("processor", "").isdigit() else i
        if allowed is not None and cpu not in allowed:
            continue
        cores.add((e.get("physical id", "0"), e.get("core id", str(cpu))))
    if cores:
        return len(cores)
    return len(allowed) if allowed else (os.cpu_count() or 1)


def cpu_clock_ghz(cpuinfo: list[dict[str, str]] | None = None,
                  max_freq_path: str = "/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") -> tuple[float, str]:
    """(GHz, where it was read): the highest clock the cores may run at (see the module doc)."""
    try:
        with open(max_freq_path) as f:
            khz = float(f.read().strip())
        if khz > 0:
            return khz / 1e6, "cpuinfo_max_freq"
    except (OSError, ValueError):
        pass
    cpuinfo = _cpuinfo() if cpuinfo is None else cpuinfo
    name = next((e.get("model name", "") for e in cpuinfo if e.get("model name")), "")
    if "@" in name and name.rstrip().upper().endswith("GHZ"):
        try:
            return float(name.rsplit("@", 1)[1].strip()[:-3]), "model name"
        except ValueError:
            pass
    mhz = [float(e["cpu mhz"]) for e in cpuinfo if e.get("cpu mhz", "").replace(".", "", 1).isdigit()]
    if mhz:
        return max(mhz) / 1000.0, "cpu MHz"
    return 2.5, "default"


def flops_per_cycle(dtype: str, flags: set[str], *, half_width_avx512: bool = False) -> tuple[float, str]:
    """(peak FLOP per cycle per core in `dtype`, the instructions it assumes) from the CPU's flags
    (see the module doc's table). `half_width_avx512`: the cores execute 512-bit instructions on
    256-bit datapaths (AMD Zen 4)."""
    if "avx512f" in flags:
        fp32, what = (32.0, "AVX-512 on 256-bit FMA x 2") if half_width_avx512 else (64.0, "AVX-512 FMA x 2")
    elif "avx2" in flags and "fma" in flags:
        fp32, what = 32.0, "AVX2 FMA x 2"
    elif "avx" in flags:
        fp32, what = 16.0, "AVX add + multiply"
    elif "asimd" in flags:
        fp32, what = 32.0, "NEON/SVE FMA, 4 x 128-bit"
    else:
        fp32, what = 8.0, "SSE add + multiply"
    if dtype == "float32":
        return fp32, what
    amx, dot = {"bfloat16": ("amx_bf16", ("avx512_bf16", "bf16")),
                "float16": ("amx_fp16", ("avx512_fp16", "asimdhp"))}.get(dtype, (None, ()))
    if amx is None:
        raise KeyError(dtype)
    if amx in flags:
        return _AMX, "AMX"
    native = next((f for f in dot if f in flags), None)
    if native is not None:
        return 2 * fp32, f"{native}, 2 x {what}"
    return fp32, f"emulated in float32: {what}"


def cpu_peak(dtype: str = "float32", *, flags: set[str] | None = None, cores: int | None = None,
             ghz: float | None = None, cpuinfo: list[dict[str, str]] | None = None,
             clock_source: str = "given") -> CpuPeak:
    """This CPU's peak FLOP/s in `dtype` over the node's cores (see the module doc).
    Arguments replace what is detected (tests, another machine's figures: the `cpu` preset's
    nominal socket, `dtorch.cluster.presets.cpu_socket_peak`); `clock_source` names where a given
    `ghz` comes from."""
    info = _cpuinfo() if cpuinfo is None and (cores is None or ghz is None or flags is None) else (cpuinfo or [])
    flags = cpu_flags() if flags is None else flags
    cores = physical_cores(info) if cores is None else cores
    source = clock_source
    if ghz is None:
        ghz, source = cpu_clock_ghz(info)
    first = info[0] if info else {}
    zen4 = first.get("vendor_id") == "AuthenticAMD" and first.get("cpu family") == "25"
    per_cycle, what = flops_per_cycle(dtype, flags, half_width_avx512=zen4)
    return CpuPeak(dtype, cores * ghz * 1e9 * per_cycle, cores, ghz, per_cycle, what, source)


def cpu_peaks(dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")) -> dict[str, float]:
    """`cpu_peak(d).flops` for each of `dtypes` (the whole CPU), read once."""
    info = _cpuinfo()
    flags = cpu_flags()
    cores = physical_cores(info)
    ghz, _ = cpu_clock_ghz(info)
    return {d: cpu_peak(d, flags=flags, cores=cores, ghz=ghz, cpuinfo=info).flops for d in dtypes}


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops_per_device: float, devices: int) -> float:
    """The one MFU formula (module doc): 0 where the peak is unknown."""
    total = peak_flops_per_device * devices
    return tokens_per_s * flops_per_token / total if total > 0 else 0.0
