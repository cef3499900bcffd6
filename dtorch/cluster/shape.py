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
