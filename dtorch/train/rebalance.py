"""Straggler response: re-cut the data-parallel shares by measured speed (opt-in, `rebalance=True`,
`dtorch train --rebalance`; docs/monitoring.md).

When the straggler watch names a persistently slow rank, its report carries every rank's measured
seconds per block call over the last window, relative to the fastest (`ratio`). A data-parallel
rank runs as fast as the slowest rank of its group (its TP/CP/PP peers wait for each other), so
its speed is ``1 / max(ratio of its ranks)``. The new shares are proportional to those speeds
(largest remainder, at least one micro-batch each, the same total: the global batch and the data
order do not change). The trainer applies them at the next checkpoint and logs a `rebalance`
event. Pure functions; every rank computes the same shares from the same gathered report.
"""

from __future__ import annotations

from collections.abc import Sequence

from dtorch.errors import ConfigError


def shares_from_speeds(speeds: Sequence[float], total: int) -> list[int]:
    """Integer shares proportional to `speeds`, each >= 1, summing to `total` (largest remainder)."""
    if not speeds or any(not (s > 0) for s in speeds):
        raise ConfigError("speeds", list(speeds), "give one positive speed per data-parallel rank")
    if int(total) < len(speeds):
        raise ConfigError("total", total, f"need at least one micro-batch for each of {len(speeds)} ranks")
    raw = [total * s / sum(speeds) for s in speeds]
    out = [max(1, int(r)) for r in raw]
    while sum(out) < total:
        out[max(range(len(raw)), key=lambda i: raw[i] - out[i])] += 1
    while sum(out) > total:
        out[max((i for i in range(len(out)) if out[i] > 1), key=lambda i: out[i] - raw[i])] -= 1
    return out


def dp_speeds(ratio: Sequence[float], dp_of_rank: Sequence[int], dp_size: int) -> list[float]:
    """Speed of each data-parallel rank (1 / seconds per block call, relative), from the
    straggler report's per-rank `ratio` and each global rank's data-parallel rank."""
    slowest = [0.0] * dp_size
    for r, d in enumerate(dp_of_rank):
        slowest[d] = max(slowest[d], float(ratio[r]))
    return [1.0 / s for s in slowest]


def rebalanced_shares(current: Sequence[int] | None, num_microbatches: int, ratio: Sequence[float],
                      dp_of_rank: Sequence[int], dp_size: int) -> list[int] | None:
    """The shares the measured speeds call for, or None when they equal the current ones (or the
    job has one data-parallel rank: nothing to move)."""
    if dp_size < 2:
        return None
    new = shares_from_speeds(dp_speeds(ratio, dp_of_rank, dp_size), dp_size * num_microbatches)
    now = list(current) if current is not None else [num_microbatches] * dp_size
    return None if new == now else new
