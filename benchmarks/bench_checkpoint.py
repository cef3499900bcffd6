"""Checkpoint cost against model size on this machine (one process, CPU, fp32).

For each size: the blocking stall of a sync save (= its whole duration) and of an async save
(the CPU staging copy), the async save's time to commit (persist), the time to verify every
file's SHA-256, and the time to load (verify + DCP read, in place). Writes
benchmarks/results/checkpoint.json and checkpoint.md.

    .venv/bin/python benchmarks/bench_checkpoint.py [--sizes 1e6,1e7,1e8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from dtorch.checkpoint import CheckpointManager

RESULTS = Path(__file__).parent / "results"
DEFAULT_SIZES = (1_000_000, 10_000_000, 100_000_000)
_COLUMNS = ("sync_save_s", "async_first_stall_s", "async_stall_s", "async_persist_s", "verify_s", "load_s")


def _model_state(num_params: int, num_tensors: int = 24) -> dict[str, torch.Tensor]:
    """`num_params` fp32 values split over `num_tensors` 2-D tensors, like a model's blocks."""
    per = max(1, num_params // num_tensors)
    cols = 1024 if per >= 1024 else per
    rows = max(1, per // cols)
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(rows, cols, generator=g) for i in range(num_tensors)}


def _measure(num_params: int, repeats: int, workdir: Path) -> dict[str, float]:
    model = _model_state(num_params)
    actual = sum(t.numel() for t in model.values())
    samples: dict[str, list[float]] = {}

    def keep(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    for r in range(repeats):
        root = workdir / f"n{num_params}-{r}"
        mgr = CheckpointManager(root, keep_last=None)
        state = {"model": model, "meta": {"step": 1}}
        t0 = time.perf_counter()
        res = mgr.save(1, state)
        keep("sync_save_s", time.perf_counter() - t0)
        res = mgr.save(2, state, async_=True)
        keep("async_first_stall_s", res.stall_s)  # allocates the CPU staging buffers
        mgr.wait()
        res = mgr.save(3, state, async_=True)
        keep("async_stall_s", res.stall_s)  # steady state: copies into the kept buffers
        mgr.wait()
        keep("async_persist_s", res.persist_s)
        t0 = time.perf_counter()
        assert mgr.verify(3).ok
        keep("verify_s", time.perf_counter() - t0)
        dst = {"model": {k: torch.empty_like(v) for k, v in model.items()}, "meta": {"step": -1}}
        t0 = time.perf_counter()
        assert mgr.load_latest(dst) == 3
        keep("load_s", time.perf_counter() - t0)
        assert all(torch.equal(dst["model"][k], v) for k, v in model.items())
        mgr.close()
        shutil.rmtree(root)
    row: dict = {"params": actual, "bytes": int(res.bytes)}
    for k, v in samples.items():  # best = least disturbed by other load; median = typical
        row[k] = round(min(v), 4)
        row[k[:-2] + "_median_s"] = round(statistics.median(v), 4)
    return row


def run(sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 3, out_dir: Path = RESULTS) -> dict:
    """Measure every size (best and median of `repeats`), write JSON + markdown under `out_dir`, return the dict."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    rows = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="dtorch-bench-ckpt-") as tmp:
        for n in sizes:
            rows.append(_measure(int(n), repeats, Path(tmp)))
    result = {
        "benchmark": "checkpoint",
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "unix_time": time.time(),
        "note": "one process, CPU tensors, local disk, best and median of repeats; stall = time the caller is blocked",
        "cpus": os.cpu_count(),
        "loadavg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "rows": rows,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "checkpoint.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Checkpoint cost vs model size (CPU, fp32, one process)",
        "",
        f"torch {result['torch']}, {result['threads']} threads, best (median) of {repeats}. "
        "Sync stall = the whole save; async stall = the CPU staging copy (the 1st save also allocates the buffers, later ones reuse them); persist = until committed. "
        f"Load average (1 min) before/after: {result['loadavg_1min_before_after']} on {result['cpus']} CPUs "
        "(the machine is shared: the best of the repeats is the least disturbed figure).",
        "",
        "| params | MB | sync save s | async stall s, 1st save | async stall s | async persist s | verify s | load s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [f"{r[k]:.3f} ({r[k[:-2] + '_median_s']:.3f})" for k in _COLUMNS]
        lines.append(f"| {r['params']:,} | {r['bytes'] / 1e6:.1f} | " + " | ".join(cells) + " |")
    (out_dir / "checkpoint.md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES), help="comma-separated parameter counts")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    run(tuple(int(float(s)) for s in args.sizes.split(",")), args.repeats)
    print((RESULTS / "checkpoint.md").read_text())
