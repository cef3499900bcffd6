"""Run a benchmark worker in ONE group of spawned processes (gloo on CPU, nccl on GPU).

`run_group(world_size, worker, payload)` spawns the ranks, joins them through a file rendezvous,
calls `worker(payload, rank, world_size)` on each and returns every rank's (JSON-able) result.
Each rank gets its share of the cores (at least one thread), as a job of that size would.
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def _entry(rank: int, world_size: int, rdzv: str, out_dir: str, worker: Callable, payload: Any,
           timeout_s: float) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads_per_rank(world_size))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    # a bounded collective timeout: a plan that fails on some ranks only (a pipeline stage raising
    # while its peers wait in recv) then fails on every rank instead of hanging the whole sweep
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{rdzv}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = worker(payload, rank, world_size)
    except Exception:  # noqa: BLE001 - reported to the runner, which prints it
        result = {"error": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run_group(world_size: int, worker: Callable, payload: Any, timeout_s: float = 120.0) -> list[Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world_size, os.path.join(tmp, "rdzv"), tmp, worker, payload, timeout_s),
                 nprocs=world_size, join=True)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]


# ---- helpers used inside workers -----------------------------------------------------------------
def reset_peak_rss() -> int:
    """Reset this process's peak resident set (Linux clear_refs 5) and return the current RSS, bytes."""
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap back, so the next peak is its own
    except OSError:
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status("VmRSS")


def peak_rss() -> int:
    """Peak resident set since the last reset, bytes."""
    return _status("VmHWM")


def _status(key: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
