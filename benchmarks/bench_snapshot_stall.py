"""What one in-memory snapshot costs the training thread, timed directly (one process, no job).

`bench_failure_cost` reports the stall inside the real 2-worker job, where it is a fraction of
a millisecond measured between steps on a shared machine: noisy. This times the same thing in
a loop, which is less sensitive to load: the failure-cost benchmark's model, trainer and
optimizer (AdamW, warm-up cosine schedule) after a few steps, then `Snapshotter.take` on the
state the elastic worker snapshots (`dtorch.elastic.worker._snapshot_state`), N times. Per take:
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


def run(takes: int = 1000, log=print) -> dict[str, Any]:
    import torch

    from dtorch.checkpoint.snapshot import Snapshotter
    from dtorch.elastic import worker
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
            snap.take(i, worker._snapshot_state(tr))
            per_take.append(time.perf_counter() - t0)
            snap.wait()
        parts = {k: statistics.median(v) for k, v in snap.parts_s.items() if v and k != "wait"}
        n_tensors = len(snap._bufs[0])
        n_bytes = sum(b.numel() * b.element_size() for b, _ in snap._bufs[0])
        snap.close()
        state = worker._snapshot_state(tr)
        sd_us = {}
        for k, v in state.items():
            xs = []
            for _ in range(300):
                t = time.perf_counter()
                v.state_dict()
                xs.append(time.perf_counter() - t)
            sd_us[k] = 1e6 * statistics.median(xs)
    load.append(os.getloadavg()[0])
    out = {"model": MODEL, "takes": takes, "tensors": n_tensors, "bytes": n_bytes, "torch": torch.__version__,
           "training_thread_us": {"median": 1e6 * statistics.median(per_take), "p10": 1e6 * _pct(per_take, 0.1),
                                  "p90": 1e6 * _pct(per_take, 0.9)},
           "parts_median_us": {k: 1e6 * v for k, v in parts.items()}, "state_dict_median_us": sd_us,
           "load_average_1min": load, "cpus": os.cpu_count()}
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
        "(`bench_failure_cost` reports that figure).", ""])


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_snapshot_stall")
    ap.add_argument("--takes", type=int, default=1000)
    args = ap.parse_args()
    r = run(args.takes, log=lambda m: print(m, file=sys.stderr, flush=True))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "snapshot_stall.json").write_text(json.dumps(r, indent=1) + "\n")
    (RESULTS / "snapshot_stall.md").write_text(markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
