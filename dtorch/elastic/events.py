"""The run's event log: one JSON object per line in `<run_dir>/events.jsonl`.

Written by the launcher (agent side: failure detected, rendezvous, workers started, recovery) and
by the workers (phases such as `load` and `replan`, the first step after a (re)start, injected
faults). Every record has `kind`, `t` (wall-clock seconds since the epoch, `time.time()`), `pid`
and, where known, `rank` and `epoch` (the membership epoch, see `dtorch.elastic.worker`).

Lines are appended with one `write` on a file opened with O_APPEND, so records from many processes
on one host never interleave (POSIX guarantees this for regular files; lines are far below a page).

`recoveries(path)` turns the log into one record per recovery with its phases timed:
detect, stop, rendezvous, start, replan, load, first_step (seconds).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from dtorch.eventlog import EVENTS_FILE, events_path, log, read  # noqa: F401  (the file itself lives on the floor)

# Worker-side phases that belong to a recovery, in the order a (re)started worker meets them:
# process-group init (`worker.init_process_group`), choosing the plan, building the model and
# optimizers, loading the checkpoint, preparing the loop (callbacks, sinks, the monitor). The trainer
# reports them with `phase(name)`; `snapshot_restore` is logged by the worker on its own.
RECOVERY_PHASES = ("pg_init", "replan", "build", "load", "prepare")
REPORTED_PHASES = ("detect", "stop", "rendezvous", "fork", "start", "pg_init", "replan", "build", "load",
                   "snapshot_restore", "prepare", "first_step")
"""The phases of a recovery record, on one time line (see `recoveries`)."""


@contextlib.contextmanager
def phase(name: str, path: str | None = None, **fields: Any) -> Iterator[None]:
    """Time a phase of this worker (`with events.phase("load"): ...`) and log it as
    `{"kind": "phase", "name": name, "start": t0, "seconds": dt}` when it ends (also on error,
    with `"ok": false`). Also marks the phase in the heartbeat so a hang inside it is named.
    """
    from dtorch.elastic import heartbeat  # local: heartbeat imports nothing of this module

    t0 = time.time()
    heartbeat.mark(phase=name)
    ok = False
    try:
        yield
        ok = True
    finally:
        log("phase", path, name=name, start=t0, seconds=time.time() - t0, ok=ok, **fields)
        heartbeat.mark(phase="step")


def recoveries(path: str) -> list[dict[str, Any]]:
    """One record per recovery found in the log, phases in seconds (None when not reported).

    A recovery starts at a `detected` event (agent side; `epoch`, `fault_t`, `detect_t`) and ends at the
    last `first_step` of the next epoch whose rendezvous followed it. Phases, on one time line:
    detect = detected - fault, stop = rendezvous start - detected (stopping the survivors), rendezvous,
    fork = rendezvous end until the first worker runs (`worker_started`: the forkserver's fork),
    start = workers spawned until their first reported phase or step (imports, the script's own
    set-up), then the worker phases (`RECOVERY_PHASES`, and `snapshot_restore`), each the longest
    rank's, first_step = longest rank's first step. `total` = end of the first step - fault.
    """
    evs = read(path)
    detections: dict[int, dict[str, Any]] = {}
    for e in evs:
        if e["kind"] == "detected":
            ep = e.get("epoch", -1)
            if ep not in detections or e["t"] < detections[ep]["t"]:
                detections[ep] = e
    out = []
    for ep, d in sorted(detections.items()):
        rdzv = next((e for e in evs if e["kind"] == "rendezvous" and e["end"] >= d["t"]
                     and e.get("epoch", -1) > ep), None)
        if rdzv is None:
            continue
        new = rdzv["epoch"]
        mine = [e for e in evs if e.get("epoch") == new]
        firsts = [e for e in mine if e["kind"] == "first_step"]
        world = rdzv.get("world_size")
        if not firsts or (world is not None and len({e["rank"] for e in firsts}) < world):
            continue  # this recovery has not finished its first step yet
        starts = [e["start"] for e in mine if e["kind"] in ("phase", "first_step")]
        spawned = min((e["t"] for e in mine if e["kind"] == "workers_started"), default=rdzv["end"])

        def longest(name: str, mine: list[dict[str, Any]] = mine) -> float | None:
            xs = [e["seconds"] for e in mine if e["kind"] == "phase" and e["name"] == name]
            return max(xs) if xs else None

        ran = [e["t"] for e in mine if e["kind"] == "worker_started"]
        fault_t = d.get("fault_t") or d["t"]
        detect_t = d.get("detect_t") or d["t"]  # when the agent saw it (it logs after stopping the rest)
        end = max(e["start"] + e["seconds"] for e in firsts)
        out.append({
            "epoch_failed": ep,
            "epoch": new,
            "cause": d.get("cause"),
            "ranks": d.get("ranks"),
            "nodes": d.get("nodes"),
            "world_size": world,
            "detect": detect_t - fault_t,
            "stop": rdzv["start"] - detect_t,
            "rendezvous": rdzv["end"] - rdzv["start"],
            "start": (min(starts) - spawned) if starts else None,
            "fork": (min(ran) - rdzv["end"]) if ran else None,
            **{name: longest(name) for name in (*RECOVERY_PHASES, "snapshot_restore")},
            "first_step": max(e["seconds"] for e in firsts),
            "total": end - fault_t,
        })
    return out


def format_recovery(r: dict[str, Any]) -> str:
    """One line for a recovery record: `recovered in 4.21 s (detect 0.10 s, ...)`."""
    parts = []
    for k in REPORTED_PHASES:
        v = r.get(k)
        if v is not None or k in ("replan", "load"):
            parts.append(f"{k} {v:.2f} s" if v is not None else f"{k} -")
    who = f"node(s) {r['nodes']}" if r.get("nodes") else f"rank(s) {r.get('ranks')}"
    return (f"recovered from {r.get('cause')} of {who} in {r['total']:.2f} s "
            f"at world size {r.get('world_size')} ({', '.join(parts)})")


def drill_report(path: str, steps: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Summary of a chaos drill: `steps` are the committed step records of the run (each with `step`,
    `epoch` and `seconds`, the step's duration; a step recorded twice counts once, the last time).

    effective_ratio = useful step time / wall time; steps_lost_per_failure = for each injected fault,
    the steps executed again after it (the interrupted step included), averaged.
    """
    last = {s["step"]: s for s in steps}
    useful = sum(s["seconds"] for s in last.values())
    faults = [e for e in read(path) if e["kind"] == "fault" and e.get("fault_kind") in ("kill", "killnode", "hang")]
    lost = []
    for f in faults:
        resumed = [s["step"] for s in steps if s.get("epoch", -1) > f.get("epoch", -1)]
        if resumed:
            lost.append(f["step"] - min(resumed) + 1)
    return {"steps": len(last), "failures": len(faults), "useful_s": useful, "wall_s": wall_s,
            "effective_ratio": useful / wall_s if wall_s > 0 else None,
            "steps_lost_per_failure": sum(lost) / len(lost) if lost else None,
            "recoveries": recoveries(path)}
