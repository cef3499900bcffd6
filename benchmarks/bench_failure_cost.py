"""What a worker failure costs: the main job (`dtorch train`, real trainer, DDP on 2 CPU workers,
durable async checkpoints every 50 steps) with one of the 2 workers SIGKILLed every 30 steps for
300 steps, mid-step (in `forward_backward`), with and without the in-memory snapshots.

Per drill: steps executed again per failure (the interrupted step included), recovery time
(fault to the end of the first step after it, from `events.jsonl`), whether every step's loss is
bit-identical to an uninterrupted run, the snapshot stall as a share of the median step time,
and the effective training time ratio (ETTR: the unique steps' time over the wall time, start-up
included; also the uninterrupted run's wall time over the drill's).

    python -m benchmarks.bench_failure_cost [--quick]

Writes benchmarks/results/failure_cost.json and failure_cost.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL = "gpt:layers=2,hidden=64,heads=2,vocab=256,seq=64"
RESULTS = Path(__file__).resolve().parent / "results"


def _train(d: str, steps: int, every: int, snapshot_every: int, timeout_s: float,
           background: bool = True) -> dict[str, Any]:
    from dtorch.elastic import events

    run_dir, ckpt = os.path.join(d, "run"), os.path.join(d, "ckpt")
    cmd = [sys.executable, "-c", "import sys; from dtorch.cli import main; sys.exit(main())", "train",
           "--nproc", "2", "--steps", str(steps), "--checkpoint-every", "50", "--checkpoint-dir", ckpt,
           "--run-dir", run_dir, "--no-progress", "--sample-tokens", "0", "--model", MODEL, "--seq-len", "64",
           "--global-batch", "8", "--plan", "dp_replicate=2", "--snapshot-every", str(snapshot_every),
           "--max-restarts", str(steps // every + 2 if every else 0)]
    if every:
        cmd += ["--chaos", f"every={every}:kill:phase=forward_backward:seed=1"]
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DTORCH_SNAPSHOT_BACKGROUND": "1" if background else "0"}
    r = subprocess.run(cmd, env=env, cwd=d, capture_output=True, text=True,
                       timeout=timeout_s)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"run exited {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}")
    with open(os.path.join(ckpt, "metrics.jsonl")) as f:
        recs = [x for x in map(json.loads, f) if "loss" in x]
    steps_log = [{"step": x["step"], "epoch": x.get("epoch", 0), "seconds": x["step_time_s"]} for x in recs]
    path = os.path.join(run_dir, events.EVENTS_FILE)
    report = events.drill_report(path, steps_log, wall)
    stalls = [e for e in events.read(path) if e["kind"] == "snapshot_stall"]
    restores = [e for e in events.read(path) if e["kind"] == "phase" and e.get("name") == "snapshot_restore"]
    faults = [e for e in events.read(path) if e["kind"] == "fault"]
    redone = []
    for f_ in faults:
        resumed = [s["step"] for s in steps_log if s["epoch"] > f_.get("epoch", -1)]
        if resumed:
            redone.append(f_["step"] - min(resumed) + 1)
    return {"wall_s": wall, "losses": {x["step"]: x["loss"] for x in recs}, "report": report, "steps": steps_log,
            "redone": redone, "median_step_s": statistics.median(x["step_time_s"] for x in recs),
            "stall_median_s": statistics.median(e["median_s"] for e in stalls) if stalls else None,
            "stall_parts_median_s": {k: statistics.median(e["parts_median_s"][k] for e in stalls
                                                          if k in e.get("parts_median_s", {}))
                                     for k in ("state_dicts", "match", "wait", "copy")
                                     if any(k in e.get("parts_median_s", {}) for e in stalls)},
            "snapshot_restores": len(restores)}


def run(quick: bool = False, log=print) -> dict[str, Any]:
    from dtorch.elastic import events

    steps, every = (120, 30) if quick else (300, 30)
    out: dict[str, Any] = {"model": MODEL, "steps": steps, "kill_every": every, "checkpoint_every": 50,
                           "workers": 2, "plan": "dp_replicate=2 (DDP)"}
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(f"{d}/base")
        log("uninterrupted run ...")
        base = _train(f"{d}/base", steps, 0, 1, 900)
        out["uninterrupted_wall_s"] = base["wall_s"]
        out["uninterrupted_median_step_s"] = base["median_step_s"]
        out["uninterrupted_stall_median_s"] = base["stall_median_s"]
        out["uninterrupted_stall_parts_median_s"] = base["stall_parts_median_s"]
        if not quick:
            # What the side thread's copy costs the steps it overlaps (it shares the cores and the
            # GIL with the next step's data loading), side by side under the same load: with a
            # snapshot after every 2nd step, the step after a snapshot against the step after none.
            # The same with the whole copy on the training thread (DTORCH_SNAPSHOT_BACKGROUND=0).
            for mode, background in (("side_thread", True), ("training_thread", False)):
                os.makedirs(f"{d}/base-every2-{mode}")
                log(f"uninterrupted run, snapshots every 2 steps, copy on the {mode.replace('_', ' ')} ...")
                e2 = _train(f"{d}/base-every2-{mode}", steps, 0, 2, 900, background=background)
                after = [x["seconds"] for x in e2["steps"] if x["step"] > 2 and x["step"] % 2 == 1]
                other = [x["seconds"] for x in e2["steps"] if x["step"] > 2 and x["step"] % 2 == 0]
                out[f"every2_{mode}"] = {"median_step_after_snapshot_s": statistics.median(after),
                                         "median_step_after_none_s": statistics.median(other),
                                         "stall_median_s": e2["stall_median_s"],
                                         "stall_parts_median_s": e2["stall_parts_median_s"]}
        drills = {"snapshots every step": 1, "durable checkpoints only": 0}
        if quick:
            drills.pop("durable checkpoints only")
        for name, snap in drills.items():
            os.makedirs(f"{d}/{name}")
            log(f"drill: {name} ...")
            r = _train(f"{d}/{name}", steps, every, snap, 1500)
            totals = [x["total"] for x in r["report"]["recoveries"]]
            out[name] = {
                "failures": r["report"]["failures"],
                "steps_redone_per_failure": r["redone"],
                "max_steps_redone": max(r["redone"], default=None),
                "recovery_s": totals,
                "recovery_median_s": statistics.median(totals) if totals else None,
                "bit_identical": r["losses"] == base["losses"],
                "snapshot_restores": r["snapshot_restores"],
                "median_step_s": r["median_step_s"],
                "snapshot_stall_median_s": r["stall_median_s"],
                "snapshot_stall_parts_median_s": r["stall_parts_median_s"],
                "snapshot_stall_pct_of_step": (100 * r["stall_median_s"] / r["median_step_s"]
                                               if r["stall_median_s"] is not None else None),
                "ettr": r["report"]["effective_ratio"],
                "wall_s": r["wall_s"],
                "uninterrupted_wall_over_drill_wall": base["wall_s"] / r["wall_s"],
                "recovery_phases_median_s": {
                    k: statistics.median(x[k] for x in r["report"]["recoveries"] if x.get(k) is not None)
                    for k in events.REPORTED_PHASES
                    if any(x.get(k) is not None for x in r["report"]["recoveries"])},
            }
            log(json.dumps(out[name], default=str)[:600])
    return out


def markdown(r: dict[str, Any]) -> str:
    lines = [f"## Failure cost: kill 1 of {r['workers']} workers every {r['kill_every']} steps for {r['steps']} steps",
             "", f"Model `{r['model']}`, plan {r['plan']}, durable checkpoints every {r['checkpoint_every']} steps. "
             f"Uninterrupted: {r['uninterrupted_wall_s']:.1f} s wall.", "",
             "| | failures | steps redone / failure (max) | recovery median | bit-identical | snapshot stall | ETTR | wall vs uninterrupted |",
             "|---|---|---|---|---|---|---|---|"]
    for name in ("snapshots every step", "durable checkpoints only"):
        x = r.get(name)
        if not x:
            continue
        stall = (f"{x['snapshot_stall_median_s'] * 1e3:.2f} ms ({x['snapshot_stall_pct_of_step']:.2f} % of "
                 f"{x['median_step_s'] * 1e3:.0f} ms)" if x["snapshot_stall_median_s"] is not None else "-")
        redone = x["steps_redone_per_failure"]
        lines.append(f"| {name} | {x['failures']} | {statistics.mean(redone):.1f} ({x['max_steps_redone']}) | "
                     f"{x['recovery_median_s']:.2f} s | {x['bit_identical']} | {stall} | {x['ettr']:.3f} | "
                     f"{x['uninterrupted_wall_over_drill_wall']:.3f} |")
    parts = r.get("uninterrupted_stall_parts_median_s") or {}
    if r.get("uninterrupted_stall_median_s") is not None:
        lines += ["", f"Snapshot stall, uninterrupted run: {r['uninterrupted_stall_median_s'] * 1e3:.3f} ms median "
                  f"({100 * r['uninterrupted_stall_median_s'] / r['uninterrupted_median_step_s']:.2f} % of the "
                  f"{r['uninterrupted_median_step_s'] * 1e3:.1f} ms median step). Where it goes (median ms): "
                  + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in parts.items())
                  + " (state_dicts + match + wait block the step; copy runs on the side thread)."]
    if r.get("every2_side_thread"):
        lines += ["", "Whole cost of a snapshot, side by side in one run each (snapshots every 2 steps: the "
                  "step after a snapshot, which overlaps the copy, against the step after none; the stall is "
                  "outside both):", "", "| copy on | stall median | step after a snapshot | step after none | difference |",
                  "|---|---|---|---|---|"]
        for mode in ("side_thread", "training_thread"):
            x = r[f"every2_{mode}"]
            a, b = x["median_step_after_snapshot_s"], x["median_step_after_none_s"]
            stall = f"{x['stall_median_s'] * 1e3:.3f} ms" if x["stall_median_s"] is not None else "-"
            lines.append(f"| {mode.replace('_', ' ')} | {stall} | {a * 1e3:.2f} ms | {b * 1e3:.2f} ms | "
                         f"{(a - b) * 1e3:+.2f} ms ({100 * (a - b) / b:+.1f} %) |")
    lines += ["", "Recovery phases (median s): " + "; ".join(
        f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in r[name]["recovery_phases_median_s"].items())
        for name in ("snapshots every step", "durable checkpoints only") if r.get(name)), "",
        "Measured on a shared, loaded 2-core machine: compare the rows of one run, not absolute seconds."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_failure_cost")
    ap.add_argument("--quick", action="store_true", help="120 steps, snapshot drill only")
    args = ap.parse_args()
    r = run(quick=args.quick, log=lambda m: print(m, file=sys.stderr, flush=True))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "failure_cost.json").write_text(json.dumps(r, indent=1, default=str) + "\n")
    (RESULTS / "failure_cost.md").write_text(markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
