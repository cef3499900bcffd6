"""Run many training cases in ONE group of gloo processes (process groups are the slow part).

`run_group(world_size, cases, worker)` starts `world_size` processes that join one gloo group
through a file rendezvous, call `worker(case, rank)` for every case in order and return, per case,
the list of each rank's result (a JSON-able value, or {"error": traceback}).

The processes are forked from one forkserver per test session that has imported torch, DTorch's
executor and transformers once (`PRELOAD`): a spawned interpreter spends 3-6 s of CPU importing
them, and a group of 4 on a 2-core machine waited for that on every call. Each process still
starts from that clean, imported state (no case has run in the server) and gets the caller's
current environment, as a spawned one would.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import multiprocessing
import os
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the forkserver; a module that fails to import is skipped there (then imported
# by the process that needs it). Only imports: nothing here reads the environment for later use.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "torch.distributed.checkpoint", "dtorch.parallel", "dtorch.train",
           "dtorch.checkpoint", "transformers", "transformers.models.llama.modeling_llama",
           "transformers.models.gpt2.modeling_gpt2"]


def _entry(rank: int, world_size: int, rdzv: str, out_dir: str, cases: list, worker, env: dict) -> None:
    # a native crash (SIGSEGV, SIGABRT) prints every thread's Python stack before the process dies:
    # spawn's own report names only the signal
    faulthandler.enable(all_threads=True)
    # The preloaded imports (over a million objects) into the permanent generation: no full
    # collection of the cases' garbage walks them again (about 1 s a process on the 2-core machine).
    gc.freeze()
    os.environ.clear()
    os.environ.update(env)  # the caller's environment now, not the forkserver's at its start
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
    multiprocessing.set_forkserver_preload(PRELOAD)  # takes effect when the server first starts
    with tempfile.TemporaryDirectory() as tmp:
        rdzv = os.path.join(tmp, "rdzv")
        mp.start_processes(_entry, args=(world_size, rdzv, tmp, cases, worker, dict(os.environ)),
                           nprocs=world_size, join=True, start_method="forkserver")
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(cases))]
