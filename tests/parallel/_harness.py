"""Run many training cases in ONE group of gloo processes (process groups are the slow part).

`run_group(world_size, cases, worker)` spawns `world_size` processes that join one gloo group
through a file rendezvous, call `worker(case, rank)` for every case in order and return, per case,
the list of each rank's result (a JSON-able value, or {"error": traceback}).
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, rdzv: str, out_dir: str, cases: list, worker) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world_size)
    results = []
    for case in cases:
        try:
            results.append(worker(case, rank))
        except Exception:  # noqa: BLE001 - reported per case, the group carries on
            results.append({"error": traceback.format_exc()})
        dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def run_group(world_size: int, cases: list, worker) -> list[list]:
    with tempfile.TemporaryDirectory() as tmp:
        rdzv = os.path.join(tmp, "rdzv")
        mp.spawn(_entry, args=(world_size, rdzv, tmp, cases, worker), nprocs=world_size, join=True)
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(cases))]
