"""How fast a device runs the work of a transformer step at a given shape: the GEMM-shape factor and
the memory passes of element-wise work, with their fitted constants.

A device's matmul throughput is ``peak x efficiency x shape_factor(width, rows)``, where the factor
``x/(x + x0)`` for the per-rank GEMM width and rows says how far small GEMMs run from peak; memory-
bound element-wise work is `ELEMENTWISE_PASSES` passes over a block's saved activations at memory
bandwidth. The probe (`dtorch.cluster.probe`) and the CPU capability timing
(`dtorch.cluster.capability`) interpret their measurements with this model, and the planner
(`dtorch.plan.cost`) predicts with it: it lives here, below both, so that imports run one way
(cluster -> plan). The constants are fitted by `python -m dtorch.plan.calibration --fit` on the
published runs; the cost model's `DEFAULT_CONSTANTS` take them from here.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

GEMM_WIDTH_HALF = 64.0
"""Per-rank GEMM width (hidden / tp) at which the shape factor is 1/2 (fitted)."""
GEMM_ROWS_HALF = 256.0
"""Per-rank tokens per micro-batch (mbs * seq / cp) at which the shape factor is 1/2 (fitted)."""
ELEMENTWISE_PASSES = 16.0
"""Memory-bound work of a block as passes over its saved activations at memory bandwidth (fitted)."""


def shape_factor(width: float, rows: float, width_half: float = GEMM_WIDTH_HALF,
                 rows_half: float = GEMM_ROWS_HALF) -> float:
    """GEMM-shape efficiency factor in (0, 1]: x/(x + x0) for per-rank width and rows."""
    return (width / (width + width_half)) * (rows / (rows + rows_half))


# ---- attention ---------------------------------------------------------------------------------
ATTENTION_KERNELS_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "published" / "kernels" / "attention.yaml"
"""Published attention-kernel speeds (the priors of `attention_efficiency`, with their provenance)."""

GENERATIONS: tuple[tuple[str, str], ...] = (
    ("A100", "ampere"), ("A800", "ampere"), ("GH200", "hopper"), ("H100", "hopper"), ("H200", "hopper"),
    ("H800", "hopper"), ("GB200", "blackwell"), ("B200", "blackwell"), ("B100", "blackwell"),
)
"""Device-name prefix -> GPU generation (whose kernel benchmarks price its attention)."""
PREVIOUS_GENERATION = {"blackwell": "hopper", "hopper": "ampere"}
SDPA_KERNEL = {"hopper": "cudnn", "blackwell": "cudnn"}
"""The kernel torch's SDPA runs by default (torch >= 2.9 with its bundled cuDNN >= 9.15 prefers
cuDNN attention on sm90/sm100: pytorch/pytorch PR 162073, `check_prefer_cudnn_attention`); the
flash-attention 2 kernel elsewhere. torch 2.5-2.8 ran flash-attention 2 on Hopper too (cuDNN made
opt-in by PR 138522): sources of that time say `attention_kernel: fa2`."""
SM_COUNT = {"ampere": 108, "hopper": 132, "blackwell": 148}
"""Streaming multiprocessors of each generation's data-center part (A100, H100/H200 SXM, B200:
NVIDIA's architecture white papers and datasheets)."""

FA_TO_MODEL_FLOPS = 12.0 / 7.0
"""flash-attention's benchmarks count a causal forward as half of 4 s^2 d per head and the backward
as 2.5 forwards (3.5 x in all); the cost model counts the full s^2 and 3 x (12 h s per token per
block): the same seconds are 12/7 as many of its FLOPs."""

UNFUSED_GEMM_SCORE_BYTES = 12.0
"""Bytes per attention-score element per head that the unfused core's batched GEMMs move, 16-bit
(one training step): QK^T writes the scores (2) and PV reads the probabilities (2) forward; the
backward's dP = dO V^T writes (2), dV = P^T dO reads P (2), dQ and dK read dS (2 + 2)."""
UNFUSED_SOFTMAX_SCORE_BYTES = 20.0
"""Bytes per score element per head of the unfused core's element-wise kernels, 16-bit: Megatron's
fused scale-mask-softmax reads the scores and writes the probabilities (4) forward, its backward
reads the gradient and the probabilities and writes dS (6); dropout on the probabilities reads
them and writes the output and a 1-byte mask (5) forward, and (5) backward."""


def generation(device_name: str) -> str | None:
    """The GPU generation of a device name (`GENERATIONS`), or None (a CPU, an unlisted part)."""
    name = device_name.upper()
    for prefix, gen in GENERATIONS:
        if name.startswith(prefix):
            return gen
    return None


def streaming_multiprocessors(device_name: str) -> int | None:
    """SMs of a device by its generation (`SM_COUNT`), or None where unknown."""
    return SM_COUNT.get(generation(device_name) or "")


@lru_cache(maxsize=1)
def _attention_table() -> dict:
    if not ATTENTION_KERNELS_FILE.is_file():  # (an installed package without the benchmarks folder)
        return {}
    import yaml

    return yaml.safe_load(ATTENTION_KERNELS_FILE.read_text()) or {}


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear in log x over the points with a value, held at the edges."""
    pts = [(a, b) for a, b in zip(xs, ys) if b is not None]
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0)
            return y0 + f * (y1 - y0)
    return pts[-1][1]


def _combined(fwd: list, bwd: list) -> list:
    """Forward + backward speed of a series (flash-attention's 3.5 x convention)."""
    return [3.5 / (1.0 / f + 2.5 / b) if f and b else None for f, b in zip(fwd, bwd)]


def _head_dim_factor(series: dict, seq: list, head_dim: float, s: float) -> float:
    """Speed at `head_dim` over speed at 128 (the series' own d=64 backward and d=256 forward where
    published: the same factor assumed for the pass not measured), log-linear in d between."""
    if head_dim < 128 and "bwd_d64" in series:
        f64 = _interp(seq, series["bwd_d64"], s) / _interp(seq, series["bwd"], s)
        return _interp([64.0, 128.0], [f64, 1.0], max(64.0, head_dim))
    if head_dim > 128 and "fwd_noncausal_d256" in series:
        f256 = _interp(seq, series["fwd_noncausal_d256"], s) / _interp(seq, series["fwd_noncausal_d128"], s)
        return _interp([128.0, 256.0], [1.0, f256], min(256.0, head_dim))
    return 1.0


def attention_efficiency(device_name: str, kernel: str, head_dim: float, seq_len: float) -> float | None:
    """Speed of a fused attention kernel's causal forward + backward over the device's dense 16-bit
    peak, in the cost model's FLOPs (full s^2, `FA_TO_MODEL_FLOPS`), at `head_dim` and `seq_len`,
    from the published benchmarks of the device's generation (`ATTENTION_KERNELS_FILE`; a newer
    generation without any borrows the previous one's fraction of peak). A kernel not benchmarked
    on that generation is priced as flash-attention 2 ('fa2', what torch's SDPA runs). None where no
    benchmark covers the generation or the file is absent: the caller prices attention as GEMMs."""
    table = _attention_table()
    devices, seq = table.get("devices") or {}, table.get("seq") or []
    gen = generation(device_name)
    if kernel == "sdpa":
        kernel = SDPA_KERNEL.get(gen or "", "fa2")
    while gen and gen not in devices:
        gen = PREVIOUS_GENERATION.get(gen)
    if not gen:
        return None
    kernels = devices[gen]["kernels"]
    k = kernels.get(kernel) or kernels.get("fa2")
    if k is None:
        return None
    s = float(seq_len)
    if "fwdbwd_fraction" in k:
        frac = _interp(seq, k["fwdbwd_fraction"], s)
        ref = ((devices.get("hopper") or {}).get("kernels") or {}).get(kernel if kernel in kernels else "fa2") or {}
    else:
        frac = _interp(seq, _combined(k["fwd"], k["bwd"]), s) / devices[gen]["peak_tflops"]
        ref = k
    factor = _head_dim_factor(ref, seq, head_dim, s) if ref else 1.0
    return frac * factor * FA_TO_MODEL_FLOPS


MEMORY_EFFICIENCY = 0.8
"""Share of HBM bandwidth a streaming kernel sustains (as the cost model's optimizer term): what the
unfused attention roofline moves its scores at."""


def unfused_attention_s(hidden: float, heads: float, seq_len: float, gemm_speed: float,
                        memory_bandwidth: float, act_bytes: float = 2.0) -> float:
    """Seconds of one token's unfused attention core per block, forward + backward (full over TP):
    the batched QK^T / PV GEMMs (12 h s FLOPs, inner dimension the head dimension) as a roofline of
    their FLOPs at `gemm_speed` and their score traffic (`UNFUSED_GEMM_SCORE_BYTES`), plus the
    softmax and dropout kernels' passes over the heads x s scores (`UNFUSED_SOFTMAX_SCORE_BYTES`).
    More heads at the same hidden size: more scores, the same FLOPs."""
    scores = heads * seq_len * act_bytes / 2.0  # score elements per token, in 16-bit units
    bw = memory_bandwidth * MEMORY_EFFICIENCY
    gemm = max(12.0 * hidden * seq_len / gemm_speed, scores * UNFUSED_GEMM_SCORE_BYTES / bw)
    return gemm + scores * UNFUSED_SOFTMAX_SCORE_BYTES / bw
