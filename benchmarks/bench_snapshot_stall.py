"""What one in-memory snapshot costs the training thread, timed directly (one process, no job).

`bench_failure_cost` reports the stall inside the real 2-worker job, where it is a fraction of
a millisecond measured between steps on a shared machine: noisy. This times the same thing in
a loop, which is less sensitive to load: the failure-cost benchmark's model, trainer and
optimizer (AdamW, warm-up cosine schedule) after a few steps, then `Snapshotter.take` on the
state the elastic worker snapshots (`Trainer.snapshot_state`), N times. Per take:
the training thread's time (the state gathered, the state dicts, the tensors listed, the copy
handed to the side thread), and the side thread's copy (joined before the next take, not
counted). The loop runs hot (caches warm); inside a job the same work runs after a step and
costs more.

    python -m benchmarks.bench_snapshot_stall [--takes N]

Writes benchmarks/results/snapshot_stall.json and snapshot_stall.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_failure_cost import MODEL

RESULTS = Path(__file__).resolve().parent / "results"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


MODES = {"side thread": {"background": True}, "training thread": {"background": False}}


def side_by_side(tr: Any, snap_dir: str, steps: int, log=print, blocks: int = 4) -> dict[str, Any]:
    """The whole cost of a snapshot inside training: real steps of the trainer, a snapshot after
    every 2nd step (as the elastic worker takes it: `take` after the step, `wait` at the next
    step's first phase), the step after a snapshot (which overlaps the side thread's copy) against
    the step after none, the stall (take + wait) outside both. The modes run in alternating
    blocks of `steps / blocks` steps each, so that a change in the machine's load hits all."""
    from dtorch.checkpoint.snapshot import Snapshotter

    res = {m: {"after": [], "none": [], "stall": []} for m in MODES}
    for _ in range(blocks):
        for mode, kw in MODES.items():
            _block(tr, Snapshotter(snap_dir, 0, 1, tag=f"side-{mode}", **kw), max(4, steps // blocks), res[mode])
    out = {}
    for mode, r in res.items():
        a, n = statistics.median(r["after"]), statistics.median(r["none"])
        out[mode] = {"step_after_snapshot_ms": 1e3 * a, "step_after_none_ms": 1e3 * n,
                     "difference_pct": 100 * (a - n) / n, "stall_median_ms": 1e3 * statistics.median(r["stall"]),
                     "steps": len(r["after"]) + len(r["none"])}
    log(json.dumps({"side_by_side": out}))
    return out


def _block(tr: Any, snap: Any, steps: int, r: dict[str, list[float]]) -> None:
    """`steps` trainer steps with `snap` taken after every 2nd, timed into `r` (see `side_by_side`)."""
    from dtorch.train import hooks

    rec: dict[str, Any] = {"t0": 0.0, "wait": 0.0, "prev": None}

    def before(step: int) -> None:
        rec["t0"], rec["wait"] = time.perf_counter(), 0.0

    def phase(name: str, step: int) -> None:
        t = time.perf_counter()
        snap.wait()
        rec["wait"] += time.perf_counter() - t

    def after(step: int, loss: float) -> None:
        dt = time.perf_counter() - rec["t0"] - rec["wait"]
        if rec["prev"] is not None:
            (r["after"] if rec["prev"] else r["none"]).append(dt)
            if rec["prev"]:
                r["stall"][-1] += rec["wait"]
        rec["prev"] = step % 2 == 0
        if rec["prev"]:
            t = time.perf_counter()
            snap.take(step, tr.snapshot_state())
            r["stall"].append(time.perf_counter() - t)

    hooks.register(before_step=before, after_step=after, on_phase=phase)
    try:
        tr.fit(steps=tr.step + steps)
    finally:
        hooks.clear()
        snap.close()
    if rec["prev"] and r["stall"]:
        r["stall"].pop()  # the last take's wait was never measured


def run(takes: int = 1000, log=print, steps: int = 400) -> dict[str, Any]:
    import torch

    from dtorch.checkpoint.snapshot import Snapshotter
    from dtorch.models import build_model
    from dtorch.plan import Plan
    from dtorch.train import Trainer
    from dtorch.train.optim import AdamW, WarmupCosine

    torch.set_num_threads(1)
    load = [os.getloadavg()[0]]
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory(dir=shm) as snap_dir:
        tr = Trainer(model=lambda: build_model(MODEL), global_batch=8, seq_len=64, checkpoint_dir=f"{d}/ckpt",
                     optimizer=AdamW(lr=1e-3, weight_decay=0.0), lr_schedule=WarmupCosine(warmup_steps=10),
                     plan=Plan(), console=False)
        tr.fit(steps=3)  # the optimizer state exists from the first step on
        snap = Snapshotter(snap_dir, 0, 1, tag="bench")
        per_take = []
        for i in range(takes):
            t0 = time.perf_counter()
            snap.take(i, tr.snapshot_state())
            per_take.append(time.perf_counter() - t0)
            snap.wait()
        parts = {k: statistics.median(v) for k, v in snap.parts_s.items() if v and k != "wait"}
        n_tensors = len(snap._bufs[0])
        n_bytes = sum(b.numel() * b.element_size() for b, _ in snap._bufs[0])
        snap.close()
        state = tr.snapshot_state()
        sd_us = {}
        for k, v in state.items():
            xs = []
            for _ in range(300):
                t = time.perf_counter()
                v.state_dict()
                xs.append(time.perf_counter() - t)
            sd_us[k] = 1e6 * statistics.median(xs)
        side = side_by_side(tr, snap_dir, steps, log)
    load.append(os.getloadavg()[0])
    out = {"model": MODEL, "takes": takes, "tensors": n_tensors, "bytes": n_bytes, "torch": torch.__version__,
           "training_thread_us": {"median": 1e6 * statistics.median(per_take), "p10": 1e6 * _pct(per_take, 0.1),
                                  "p90": 1e6 * _pct(per_take, 0.9)},
           "parts_median_us": {k: 1e6 * v for k, v in parts.items()}, "state_dict_median_us": sd_us,
           "load_average_1min": load, "cpus": os.cpu_count(), "side_by_side": side}
    log(json.dumps(out))
    return out


def markdown(r: dict[str, Any]) -> str:
    t = r["training_thread_us"]
    p = r["parts_median_us"]
    return "\n".join([
        "## Snapshot stall per take, direct timing loop", "",
        f"Model `{r['model']}` (the failure-cost benchmark's), AdamW, one process, {r['takes']} takes of "
        f"{r['tensors']} tensors ({r['bytes'] / 1e6:.2f} MB); torch {r['torch']}. Load average (1 min) "
        f"before/after: {r['load_average_1min'][0]:.1f} / {r['load_average_1min'][1]:.1f} on {r['cpus']} CPUs.", "",
        "| training thread per take: median | p10 | p90 | state dicts | tensors listed + hand-off | side thread's copy |",
        "|---|---|---|---|---|---|",
        f"| {t['median']:.0f} us | {t['p10']:.0f} us | {t['p90']:.0f} us | {p.get('state_dicts', 0):.0f} us | "
        f"{p.get('match', 0):.0f} us | {p.get('copy', 0):.0f} us |", "",
        "State dicts, median per call: " + ", ".join(f"{k} {v:.1f} us" for k, v in r["state_dict_median_us"].items())
        + ".", "",
        "A hot loop: inside a job the same work follows a step with cold caches and costs more "
        "(`bench_failure_cost` reports that figure).", "",
        "Inside training, side by side (the trainer's real steps, a snapshot after every 2nd step, the "
        "modes in alternating blocks; the stall, take + wait, is outside the step times):", "",
        "| copy on | stall median | step after a snapshot | step after none | difference |",
        "|---|---|---|---|---|",
        *[f"| {m} | {v['stall_median_ms']:.3f} ms | {v['step_after_snapshot_ms']:.2f} ms | "
          f"{v['step_after_none_ms']:.2f} ms | {v['difference_pct']:+.1f} % |" for m, v in r["side_by_side"].items()],
        ""])


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_snapshot_stall")
    ap.add_argument("--takes", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=400, help="training steps per mode, side by side (default 400)")
    args = ap.parse_args()
    r = run(args.takes, log=lambda m: print(m, file=sys.stderr, flush=True), steps=args.steps)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "snapshot_stall.json").write_text(json.dumps(r, indent=1) + "\n")
    (RESULTS / "snapshot_stall.md").write_text(markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
