"""What a CPU can compute in each precision: detected from its flags, then measured in well under a
second.

A precision the hardware only emulates is not a faster precision. On an x86 CPU without
``avx512_bf16``/``amx_bf16`` PyTorch computes bfloat16 by converting to float32 and back, and a
bfloat16 step of a small GPT measured ~20x slower than float32 (2.8 s against 0.13 s); with the
flag it runs at about float32's speed, with AMX several times faster. So the planner never assumes:

- `cpu_dtype_support()` reads the kernel's CPU flags (``/proc/cpuinfo``; torch-free) and says, per
  dtype, whether the hardware has it natively;
- `nominal_ratios()` turns that into peak ratios against float32, the numbers a planner uses before
  anything is measured;
- `measured(threads, workload)` times a transformer block's forward and backward of the model's
  shape per dtype (autocast, as the executor runs it) with the threads one rank gets (about 0.2-0.5
  s, torch needed), and caches the answer per CPU model, flags, torch version, thread count and shape in
  ``~/.cache/dtorch/capability.json`` so that `dtorch plan` and `dtorch train` on one machine see
  the same numbers. `dtorch probe` measures the whole curve and replaces both.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path

from dtorch import env

DTYPES = ("float32", "bfloat16", "float16")

# x86 flag names (Linux /proc/cpuinfo) and aarch64 feature names that mean native support
_NATIVE_FLAGS = {
    "bfloat16": {"avx512_bf16": "dot", "amx_bf16": "matrix", "bf16": "dot"},
    "float16": {"avx512_fp16": "dot", "amx_fp16": "matrix", "asimdhp": "dot"},
}
# Training speed over float32 per kind of support, before anything is measured: with dot-product
# instructions bf16 GEMMs run ~2x float32's but attention and element-wise kernels slower (a small
# GPT's step: 0.25 s bf16 against 0.18 s fp32 on an AVX512-BF16 EPYC, torch 2.13); matrix engines
# (AMX) several times faster; emulation about 20x slower (measured on an AVX2-only CPU).
_RATIO = {"matrix": 3.0, "dot": 0.8, "emulated": 0.05}
ENV_CACHE = "DTORCH_CAPABILITY_CACHE"


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the kernel reports them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("flags", "features"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "cpu part")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_dtype_support(flags: set[str] | None = None) -> dict[str, str]:
    """Per dtype: 'native' (float32), 'matrix' / 'dot' (hardware instructions for it) or 'emulated'."""
    flags = cpu_flags() if flags is None else flags
    out = {"float32": "native"}
    for dtype, names in _NATIVE_FLAGS.items():
        kinds = [kind for name, kind in names.items() if name in flags]
        out[dtype] = "matrix" if "matrix" in kinds else ("dot" if kinds else "emulated")
    return out


def nominal_ratios(flags: set[str] | None = None) -> dict[str, float]:
    """Training speed of each dtype over float32's, from the detected support alone."""
    support = cpu_dtype_support(flags)
    return {d: 1.0 if kind == "native" else _RATIO[kind] for d, kind in support.items()}


def _cache_path() -> Path:
    cache = env.current().capability_cache
    return Path(cache) if cache else Path.home() / ".cache" / "dtorch" / "capability.json"


def _torch_version() -> str:
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:  # noqa: BLE001 - any failure means "unknown"
        return "unknown"


def _key(threads: int, workload: tuple[int, int, int]) -> str:
    raw = json.dumps([cpu_model(), sorted(cpu_flags()), _torch_version(), threads, list(workload)])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _read_cache() -> dict:
    try:
        doc = json.loads(_cache_path().read_text())
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError, UnicodeDecodeError):
        return {}


def _write_cache(doc: dict) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".capability-")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs the measurement next time


DEFAULT_WORKLOAD = (512, 8, 256)
"""(hidden, heads, seq) of the block timed when the model is not known."""
MAX_HIDDEN, MAX_SEQ = 512, 256
"""The timed block is at most this wide and long (a rank's share of a small CPU stays sub-second)."""


def _best_time(fn, reps: int) -> float:
    """The fastest of `reps` calls of `fn` (the minimum shrugs off a loaded machine's stalls)."""
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _block(hidden: int, heads: int, seq: int, batch: int):
    """A pre-norm transformer block's training work at one sequence: fused QKV, causal attention,
    output projection, a 4x GELU MLP, forward and backward."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.qkv, self.o = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            q, k, v = self.qkv(self.n1(x)).view(batch, seq, 3, heads, hidden // heads).permute(2, 0, 3, 1, 4)
            a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(batch, seq, hidden))
            return x + self.down(nn.functional.gelu(self.up(self.n2(x))))

    return Block(), torch.randn(batch, seq, hidden, requires_grad=True)


def block_shape(workload: tuple[int, int, int]) -> tuple[int, int, int, int]:
    """(hidden, heads, seq, batch) of the block timed for `workload` (capped, about 512 tokens)."""
    hidden, heads, seq = workload
    heads = max(1, min(heads, hidden // 16))
    hidden = max(heads * 16, min(hidden, MAX_HIDDEN) // heads * heads)
    seq = max(16, min(seq, MAX_SEQ))
    return hidden, heads, seq, max(1, 512 // seq)


def measure_speeds(threads: int, workload: tuple[int, int, int] = DEFAULT_WORKLOAD, *,
                   rounds: int = 5) -> dict[str, float]:
    """Training speed of each dtype over float32's on `threads` threads, for a transformer block of
    `workload` = (hidden, heads, seq) (capped at MAX_HIDDEN x MAX_SEQ, about 512 tokens): float32 as
    is, a 16-bit dtype under autocast as the executor runs it, timed in alternation and compared by
    their fastest rounds. A dtype whose GEMM runs under a quarter of float32's speed is emulated and
    is not timed further (its GEMM ratio stands for it). About 0.1-0.5 s."""
    import torch

    hidden, heads, seq, batch = block_shape(workload)
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a, b = torch.randn(128, 128), torch.randn(128, 128)
        gemm = {}
        for d in DTYPES:
            x, y = a.to(getattr(torch, d)), b.to(getattr(torch, d))
            gemm[d] = 1.0 / _best_time(lambda x=x, y=y: torch.mm(x, y), 5)
        block, x = _block(hidden, heads, seq, batch)

        def step(dtype):
            with torch.autocast("cpu", dtype=getattr(torch, dtype), enabled=dtype != "float32"):
                y = block(x)
            y.float().sum().backward()

        timed = ["float32"] + [d for d in DTYPES[1:] if gemm[d] >= 0.25 * gemm["float32"]]
        for d in timed:
            step(d)  # warm-up: the first call picks the kernels
        best = {d: math.inf for d in timed}
        for _ in range(rounds):
            for d in timed:
                best[d] = min(best[d], _best_time(lambda d=d: step(d), 1))
    finally:
        torch.set_num_threads(old)
    out = {d: best["float32"] / best[d] if d in best else gemm[d] / gemm["float32"] for d in DTYPES}
    out["float32_block_s"] = best["float32"]
    return out


def measured(threads: int, workload: tuple[int, int, int] = DEFAULT_WORKLOAD) -> dict[str, float]:
    """`measure_speeds(threads, workload)`, measured once per CPU model, flags, torch, thread count
    and workload shape."""
    key = _key(threads, workload)
    doc = _read_cache()
    entry = doc.get(key)
    try:
        return {d: float(entry["speed"][d]) for d in (*DTYPES, "float32_block_s")}
    except (TypeError, KeyError, ValueError):
        pass
    speeds = measure_speeds(threads, workload)
    doc[key] = {"speed": speeds, "cpu": cpu_model(), "threads": threads, "workload": list(workload),
                "torch": _torch_version()}
    _write_cache(doc)
    return speeds


def _can_measure() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def cpu_speeds(threads: int, *, measure: bool = True,
               workload: tuple[int, int, int] | None = None) -> tuple[dict[str, float], str]:
    """(training speed of each dtype over float32's, where it came from: 'measured' or 'flags').
    Measuring needs torch; without it, or with `measure` False, the flags decide. A measured result
    also carries 'float32_block_s', the float32 block's best time (see `speed_scale`)."""
    if measure and _can_measure():
        return measured(threads, workload or DEFAULT_WORKLOAD), "measured"
    return nominal_ratios(), "flags"


def speed_scale(block_s: float, workload: tuple[int, int, int], peak_flops: float, efficiency: float,
                memory_bandwidth: float) -> float:
    """How much faster the timed float32 block ran than the cost model predicts it on a device of
    nominal `peak_flops`, `efficiency` and `memory_bandwidth` (one rank's share): the factor by which
    those nominal numbers are scaled, so that before any probe the model's arithmetic and element-wise
    terms add up to what this CPU measurably does at the model's shape. The block's work is counted
    as the cost model counts it: 72 h^2 + 12 h s FLOPs per token, 34 h bytes of 16-bit activations per
    token through `ELEMENTWISE_PASSES` passes (`dtorch.cluster.shape`, the device model the planner
    predicts with)."""
    from dtorch.cluster.shape import ELEMENTWISE_PASSES, shape_factor

    hidden, _, seq, batch = block_shape(workload)
    tokens = batch * seq
    flops = tokens * (72.0 * hidden * hidden + 12.0 * hidden * seq)
    t = flops / (peak_flops * efficiency * shape_factor(hidden, tokens))
    t += ELEMENTWISE_PASSES * 2.0 * tokens * 34.0 * hidden / memory_bandwidth
    return t / block_s
