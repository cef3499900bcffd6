"""A second, independent measurement of communication time: torch's profiler over one window of
steps, to check `CommTimer` (the per-rank metrics' ``comm_<axis>``) against it.

`CommTimer` times Python entry points (`wait_tensor`, `Work.wait`, blocking c10d calls). The
profiler sees something else: every dispatcher op the rank's training thread runs, whoever calls
it (Python, or C++ autograd during backward), and the backend's own work items on its worker
threads. From one profiled window this module derives, per rank and per step:

- ``exposed_s``: the union of the training thread's intervals inside communication ops
  (``_c10d_functional::*``, ``_c10d_functional_autograd::*``, ``c10d::*``): what that thread spent
  launching and waiting for collectives (``wait_s``: the waits alone);
- ``flight_s``: the union of the backend's work items (``gloo:*``, ``nccl:*``) on every other
  thread: how long collectives were in flight, exposed or not.

What the profiler cannot see: the wait inside a *blocking* c10d call (`dist.all_reduce` without
``async_op``) is C++ below the op, so it is in neither ``exposed_s`` (only the launch is) nor
anywhere on the training thread; it is in ``flight_s``. A tensor-parallel step (DTensor's
functional collectives) has none; data-parallel gradient syncs on gloo do.

Enabled with ``DTORCH_PROFILE_COMMS=1`` (and per-rank metrics on): the profiler runs over the second
metrics window (steps every+1 .. 2 x every; the first carries one-time work) and each rank writes
``<log_dir>/comm-profile-rank<r>.json``. It slows those steps (the profiler records every op), so
it is a check, not a monitor: compare it with the ``ranks`` record of step 2 x every, which covers
exactly the same steps (`benchmarks/bench_monitor.py` and tests/monitor do).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

COMM_OP_PREFIXES = ("_c10d_functional::", "_c10d_functional_autograd::", "c10d::")
FLIGHT_PREFIXES = ("gloo:", "nccl:")


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start_us, end_us) intervals."""
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e6


def summarise(events: Iterable[tuple[str, Any, float, float]]) -> dict[str, Any]:
    """From profiler events (name, thread, start_us, duration_us): the training thread (the thread
    that ran the most ``aten::`` ops), the union of its communication-op intervals (``exposed_s``),
    the union of backend work items on other threads (``flight_s``), and per-op counts and seconds."""
    evs = list(events)
    aten: dict[Any, int] = {}
    for name, thread, _, _ in evs:
        if name.startswith("aten::"):
            aten[thread] = aten.get(thread, 0) + 1
    main = max(aten, key=aten.get) if aten else None
    exposed, waits, flight = [], [], []
    ops: dict[str, list[float]] = {}
    for name, thread, start, dur in evs:
        if thread == main and name.startswith(COMM_OP_PREFIXES):
            exposed.append((start, start + dur))
            if name.endswith("wait_tensor") or name.endswith("::wait"):
                waits.append((start, start + dur))
        elif thread != main and name.startswith(FLIGHT_PREFIXES):
            flight.append((start, start + dur))
            o = ops.setdefault(name, [0, 0.0])
            o[0] += 1
            o[1] += dur / 1e6
    return {"exposed_s": _union_s(exposed), "wait_s": _union_s(waits), "flight_s": _union_s(flight),
            "ops": {k: {"count": int(v[0]), "seconds": round(v[1], 6)} for k, v in sorted(ops.items())}}


def profile_path(log_dir: str | os.PathLike, rank: int) -> str:
    return os.path.join(log_dir, f"comm-profile-rank{rank}.json")


class CommProfile:
    """Profiles steps `first`..`last` (inclusive) of this rank: `after_step(step)` starts the
    profiler after step first-1 and stops it after step `last`, then writes the summary."""

    def __init__(self, *, rank: int, first: int, last: int, out_dir: str | os.PathLike):
        self.rank, self.first, self.last, self.out_dir = rank, first, last, out_dir
        self._prof = None
        self.result: dict[str, Any] | None = None

    def stop_if_due(self, step: int) -> None:
        """Call after step `step`, before anything that is not part of the step (the metrics gather)."""
        if self._prof is None or step != self.last:
            return
        self._prof.__exit__(None, None, None)
        evs = [(e.name, e.thread, e.time_range.start, e.time_range.elapsed_us()) for e in self._prof.events()]
        self._prof = None
        n = self.last - self.first + 1
        s = summarise(evs)
        self.result = {"rank": self.rank, "first_step": self.first, "last_step": self.last, "steps": n,
                       "exposed_s_per_step": s["exposed_s"] / n, "wait_s_per_step": s["wait_s"] / n,
                       "flight_s_per_step": s["flight_s"] / n,
                       "ops": s["ops"]}
        os.makedirs(self.out_dir, exist_ok=True)
        with open(profile_path(self.out_dir, self.rank), "w") as f:
            json.dump(self.result, f, indent=1)

    def start_if_due(self, step: int) -> None:
        """Call after step `step` and after the metrics gather: starts when step `first` is next."""
        if step + 1 != self.first or self._prof is not None or self.result is not None:
            return
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU])
        self._prof.__enter__()

    def close(self) -> None:
        if self._prof is not None:  # the run ended inside the window: nothing to compare
            self._prof.__exit__(None, None, None)
            self._prof = None
