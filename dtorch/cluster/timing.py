"""How the probe times a piece of work: `timeit` (seconds per call, whole blocks of calls) and
`sync` (wait for the device). A leaf: `probe` and `host` both time with it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeit(fn: Callable[[], Any], device, *, min_time: float, max_reps: int = 10_000, blocks: int = 3,
           agree: Callable[[int], int] | None = None) -> float:
    """Seconds per call of `fn`: the median over `blocks` blocks of back-to-back calls, each block
    at least `min_time` long. Timing whole blocks (not single calls) keeps the time a rank spends
    descheduled while other ranks share its cores: that is the throughput a job's rank gets.
    `agree` turns this rank's count of calls per block into the one every rank uses (a collective
    must run as often on every rank)."""
    fn()
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    one = max(time.perf_counter() - t, 1e-7)
    reps = max(1, min(max_reps, int(min_time / one) + 1))
    if agree is not None:
        reps = agree(reps)
    per_call = []
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(device)
        per_call.append((time.perf_counter() - t) / reps)
    return statistics.median(per_call)
