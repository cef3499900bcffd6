"""Statistics of predictions against measurements (pure Python, no numpy needed)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def ranks(xs: Sequence[float]) -> list[float]:
    """1-based ranks, ties get the mean of the ranks they span."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return out


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Pearson correlation; nan when either side is constant or fewer than 2 points."""
    if len(xs) != len(ys):
        raise ValueError("sequences differ in length")
    n = len(xs)
    if n < 2:
        return math.nan
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return math.nan
    return sxy / math.sqrt(sxx * syy)


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman rank correlation (Pearson of tie-averaged ranks)."""
    return pearson(ranks(xs), ranks(ys))


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error, as a fraction: mean(|p - m| / m)."""
    if len(predicted) != len(measured) or not measured:
        raise ValueError("need equal, non-empty sequences")
    return sum(abs(p - m) / m for p, m in zip(predicted, measured)) / len(measured)


def regret(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Measured time of the plan the prediction ranks first over the best measured time (>= 1).
    Ties in the prediction go to the first such plan (the planner's own order)."""
    if len(predicted) != len(measured) or not measured:
        raise ValueError("need equal, non-empty sequences")
    chosen = min(range(len(predicted)), key=lambda i: predicted[i])
    return measured[chosen] / min(measured)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def mean_tree(a, b):
    """Two measurements of the same shape (nested dicts and lists of numbers, e.g. two `dtorch
    probe` calibrations) averaged leaf by leaf; where the shapes differ, or a leaf is not a number
    (names, dates, flags), `a`'s value is kept."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: mean_tree(v, b[k]) if k in b else v for k, v in a.items()}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [mean_tree(x, y) for x, y in zip(a, b)]
    num = (int, float)
    if isinstance(a, num) and isinstance(b, num) and not isinstance(a, bool) and not isinstance(b, bool):
        return (a + b) / 2
    return a
