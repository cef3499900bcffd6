"""Every rank's step, split into terms, gathered every N steps without adding a sync to the step.

Each rank times its own steps with `perf_counter` (no device synchronisation is added; on GPUs the
loss read at the end of every step already synchronises): data wait, forward/backward, optimizer,
and, from `CommTimer`, the seconds its host thread was blocked in collectives per mesh axis. From
those:

- ``compute``  = forward/backward - communication waited for inside it
- ``comm_<axis>`` = blocking communication on that mesh axis (``comm_pp`` is the pipeline's
  send/receive waits: the bubble and the transfers together; it needs the pp collectives to go
  through the c10d Python API, see comms.py)
- ``optimizer``, ``data``; ``other`` = the rest of the step (gradient clipping, logging)
- ``fwd_blocks`` (not a term: it is inside compute) = the forward time of the model's blocks

Every `every` steps all ranks all_gather one float64 vector of window means (one small collective
per N steps, outside the timed step), rank 0 turns it into a ``ranks`` record (metrics.jsonl, the
page, Prometheus) and names the slowest rank: the one whose own work is longest, since in
synchronous training everybody else's excess time is waiting for it. A rank's own work is data +
optimizer + 3 x its blocks' forward time (forward + backward ~ 3 forwards) when the blocks were
timed, else data + compute + optimizer: under DDP the gradient all-reduce is waited for inside
C++ during backward, invisible to `CommTimer`, so "compute" of the fast ranks includes their
wait for the slow one and would hide it.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any

import torch

from dtorch.cluster.peak import mfu as peak_mfu
from dtorch.monitor import nvml
from dtorch.monitor.comms import AXES

TERMS = ("data", "compute", *[f"comm_{a}" for a in AXES], "optimizer", "other")
"""Step-time terms per rank, seconds per step; they add up to ``step``."""

FIELDS = ("steps", "step", "max_step", *TERMS, "fwd_blocks", "tokens_per_s", "mfu", "mem_current_bytes", "mem_peak_bytes",
          "mem_reserved_bytes", "gpu_util", "gpu_temp_c", "gpu_sm_clock_mhz", "gpu_power_w", "gpu_throttle_mask", "pid")

PREDICTED_OF = {  # measured term -> the planner's time_breakdown keys it corresponds to
    "compute": ("compute", "recompute", "host"),
    "comm_tp": ("tp",),
    "comm_cp": ("cp",),
    "comm_dp_shard": ("fsdp",),
    "comm_dp_replicate": ("dp",),
    "comm_pp": ("pp_p2p", "bubble"),
    "optimizer": ("optimizer", "offload"),
}
STRAGGLER_RATIO = 1.5
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Current resident set of this process, bytes (Linux /proc; the peak where that is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def predicted_terms(predicted: dict | None) -> dict[str, float]:
    """The plan's predicted seconds per step for each measured term (only terms it predicts)."""
    br = (predicted or {}).get("time_breakdown") or {}
    if not br:
        return {}
    out = {}
    for term, keys in PREDICTED_OF.items():
        v = sum(float(br.get(k, 0.0)) for k in keys)
        if v > 0 or term == "compute":
            out[term] = v
    return out


class RankCollector:
    """Per-rank window of step terms; `step(...)` per step (cheap), `maybe_gather(step)` on every
    rank after every step (collective every `every` steps; returns the rows on rank 0)."""

    def __init__(self, *, rank: int, world: int, device: torch.device, every: int = 10,
                 tokens_per_step: int = 0, flops_per_token: float = 0.0, peak_flops: float = 0.0,
                 comm: Any = None):
        self.rank, self.world, self.device, self.every = rank, world, device, max(1, int(every))
        self.tokens_per_step, self.flops_per_token, self.peak_flops = tokens_per_step, flops_per_token, peak_flops
        self.comm = comm
        self._reset()
        self.gathers = 0

    def _reset(self) -> None:
        self.n = 0
        self.sums = dict.fromkeys(TERMS, 0.0)
        self.sums["step"] = 0.0
        self.sums["fwd_blocks"] = 0.0
        self.max_step = 0.0

    # ---- per step ----------------------------------------------------------------------------
    def comm_snapshot(self) -> dict[str, float] | None:
        return self.comm.snapshot() if self.comm is not None else None

    def step(self, *, step_s: float, data_s: float, fb_s: float, opt_s: float,
             comm_fb: dict[str, float] | None = None, comm_all: dict[str, float] | None = None,
             fwd_blocks_s: float = 0.0) -> None:
        """One step's host times (seconds). `comm_fb`/`comm_all`: per-axis blocking communication
        inside forward/backward / inside the whole step (differences of `comm_snapshot()`)."""
        s = self.sums
        c_fb = sum(comm_fb.values()) if comm_fb else 0.0
        compute = max(0.0, fb_s - c_fb)
        c_all = 0.0
        if comm_all:
            for a, v in comm_all.items():
                s[f"comm_{a}"] += v
                c_all += v
        s["data"] += data_s
        s["compute"] += compute
        s["optimizer"] += opt_s
        s["other"] += max(0.0, step_s - data_s - compute - c_all - opt_s)
        s["step"] += step_s
        s["fwd_blocks"] += fwd_blocks_s
        self.max_step = max(self.max_step, step_s)
        self.n += 1

    # ---- every N steps -------------------------------------------------------------------------
    def local_row(self) -> list[float]:
        n = max(self.n, 1)
        step = self.sums["step"] / n
        tps = self.tokens_per_step / step if step > 0 else 0.0
        mfu = peak_mfu(tps, self.flops_per_token, self.peak_flops, self.world)
        if self.device.type == "cuda":
            mem = [float(torch.cuda.memory_allocated(self.device)), float(torch.cuda.max_memory_allocated(self.device)),
                   float(torch.cuda.memory_reserved(self.device))]
            gpu = nvml.sample(self.device.index or 0) or {}
        else:
            now = float(rss_bytes())  # statm counts pages ru_maxrss may not yet: the peak is never below now
            mem = [now, max(now, float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024), float("nan")]
            gpu = {}
        nan = float("nan")
        return [float(self.n), step, self.max_step, *[self.sums[t] / n for t in TERMS], self.sums["fwd_blocks"] / n,
                tps, mfu, *mem,
                *[gpu.get(k, nan) for k in ("gpu_util", "gpu_temp_c", "gpu_sm_clock_mhz", "gpu_power_w",
                                            "gpu_throttle_mask")], float(os.getpid())]

    def maybe_gather(self, step: int) -> list[dict[str, float]] | None:
        """Every `every` steps: all ranks' rows (rank 0; others get None). Collective when due."""
        if step % self.every or self.n == 0:
            return None
        row = self.local_row()
        self._reset()
        self.gathers += 1
        import torch.distributed as dist

        if dist.is_initialized() and self.world > 1:
            dev = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
            mine = torch.tensor(row, dtype=torch.float64, device=dev)
            out = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(out, mine)
            rows = [t.cpu().tolist() for t in out]
        else:
            rows = [row]
        if self.rank != 0:
            return None
        return [dict(zip(FIELDS, r)) for r in rows]


def _clean(x: float) -> float | None:
    return None if x != x else round(x, 9)  # NaN (not measured) -> null in JSON


def own_work(r: dict[str, float]) -> float:
    """Seconds per step of work a rank does itself, without waiting for others (see module doc)."""
    fwd = r.get("fwd_blocks") or 0.0
    return r["data"] + r["optimizer"] + (3.0 * fwd if fwd > 0 else r["compute"])


def ranks_record(rows: list[dict[str, float]], step: int, predicted: dict | None = None) -> dict[str, Any]:
    """The ``ranks`` record written to metrics.jsonl: per-rank terms and memory, the slowest rank
    and the stragglers, and the plan's predicted terms next to the ranks' mean."""
    own = [own_work(r) for r in rows]
    fastest = max(min(own), 1e-12)
    slowest = max(range(len(own)), key=lambda i: own[i])
    ratio = [o / fastest for o in own]
    per_rank = []
    for i, r in enumerate(rows):
        d = {"rank": i, **{k: _clean(v) for k, v in r.items() if k not in ("steps", "pid")},
             "steps": int(r["steps"]), "pid": int(r.get("pid", 0)),
             "own_ratio": round(ratio[i], 4)}
        mask = r.get("gpu_throttle_mask")
        if mask == mask and mask:
            d["gpu_throttle"] = nvml.throttle_names(int(mask))
        per_rank.append(d)
    mean = {t: sum(r[t] for r in rows) / len(rows) for t in ("step", *TERMS)}
    rec: dict[str, Any] = {
        "step": step, "wall": time.time(), "terms": list(TERMS), "ranks": per_rank,
        "mean": {k: round(v, 9) for k, v in mean.items()},
        "slowest_rank": slowest, "slowest_ratio": round(ratio[slowest], 4),
        "stragglers": [i for i, x in enumerate(ratio) if x >= STRAGGLER_RATIO],
        "throttling": [i for i, d in enumerate(per_rank) if d.get("gpu_throttle")],
    }
    pred = predicted_terms(predicted)
    if pred:
        rec["predicted"] = {k: round(v, 9) for k, v in pred.items()}
        if predicted and predicted.get("step_time_s"):
            rec["predicted"]["step"] = round(float(predicted["step_time_s"]), 9)
    return rec
