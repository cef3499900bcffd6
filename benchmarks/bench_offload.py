"""Memory tiers of the optimizer on this machine: peak RSS and step time of a ~310M-parameter
Llama trained in memory, with the host tier and with the NVMe tier (state and fp32 masters in
files), plus the disk bandwidth the NVMe tier reached and the disk probe's figures.

    .venv/bin/python -m benchmarks.bench_offload [--steps 3] [--dir /local/nvme/tmp] [--quick]

Each tier runs in its own process (its peak RSS is its own), one after the other, with the same
optimizer kernel (torch's fused CPU AdamW) so the step times compare tiers, not kernels. On a CPU
machine "device" and "host" are the same memory: the host tier *adds* its fp32 masters there, the
NVMe tier removes the optimizer state. Writes benchmarks/results/offload.json and offload.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = dict(dim=1024, n_layers=26, n_heads=16, n_kv_heads=4, vocab_size=8192, max_seq_len=256)
TIERS = ("none", "host", "nvme")


def _child(tier: str, steps: int, directory: str, log_dir: str) -> dict:
    import torch

    from dtorch.models.configs import LlamaConfig
    from dtorch.models.llama import Llama
    from dtorch.plan.plan import Plan
    from dtorch.train.offload import OptimizerOffload
    from dtorch.train.optim import AdamW
    from dtorch.train.trainer import Trainer

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    offload = {"none": None, "host": OptimizerOffload("host"),
               "nvme": OptimizerOffload("nvme", directory=directory, params_on_disk=True)}[tier]
    cfg = LlamaConfig(**MODEL)
    tr = Trainer(model=lambda: Llama(cfg), plan=Plan(microbatch_size=1), global_batch=1, seq_len=32,
                 optimizer=AdamW(lr=1e-4, fused=True), offload=offload or "none", console=False, straggler_every=0,
                 metrics_every=0, log_dir=log_dir, max_grad_norm=1.0)
    res = tr.fit(steps)
    times = []
    for line in Path(log_dir, "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "step_time_s" in rec and rec.get("step") is not None:
            times.append(rec["step_time_s"])
    opt = tr.optimizers[0]
    out = {"tier": tier, "params": sum(p.numel() for p in tr.parallel.parameters()),
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "step_times_s": times, "losses": [res.losses[s] for s in sorted(res.losses)]}
    if hasattr(opt, "io_stats"):
        out["io"] = opt.io_stats()
        out["memory"] = opt.memory()
        opt.close()
    return out


def run(steps: int = 3, directory: str | None = None, quick: bool = False, log=print) -> dict:
    from dtorch.cluster.disk import measure_disk

    steps = 2 if quick else steps
    base = Path(directory or tempfile.gettempdir())
    out: dict = {"model": MODEL, "steps": steps, "directory": str(base), "cpu_count": os.cpu_count(),
                 "note": "measured on a 2-core machine shared with other sessions: step times are noisy, "
                         "the RSS figures are per process and not affected"}
    out["disk_probe"] = measure_disk(base, nbytes=(128 if quick else 512) * 2**20)
    runs = {}
    for tier in TIERS:
        with tempfile.TemporaryDirectory(dir=base) as work:
            t = time.perf_counter()
            cmd = [sys.executable, "-m", "benchmarks.bench_offload", "--child", tier, "--steps", str(steps),
                   "--dir", work]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
            if proc.returncode:
                raise RuntimeError(f"{tier} tier failed:\n{proc.stderr[-3000:]}")
            runs[tier] = json.loads(proc.stdout.strip().splitlines()[-1])
            log(f"offload {tier}: peak RSS {runs[tier]['peak_rss_bytes'] / 2**30:.2f} GiB, "
                f"{time.perf_counter() - t:.0f} s")
    out["runs"] = runs
    n = runs["none"]["params"]
    states = 8 * n  # AdamW: exp_avg + exp_avg_sq in float32
    buf = runs["nvme"]["memory"]["buffer_bytes"]
    drop = runs["none"]["peak_rss_bytes"] - runs["nvme"]["peak_rss_bytes"]
    later = {t: r["step_times_s"][1:] or r["step_times_s"] for t, r in runs.items()}  # after the first
    med = {t: sorted(v)[len(v) // 2] for t, v in later.items()}
    io = runs["nvme"]["io"]
    out["summary"] = {
        "params": n, "optimizer_state_bytes": states, "prefetch_buffer_bytes": buf,
        "rss_drop_bytes": drop, "rss_drop_target_bytes": states - buf, "rss_drop_met": drop >= states - buf,
        "median_step_s": med, "step_cost_vs_memory": {t: med[t] / med["none"] for t in med},
        "losses_identical": runs["none"]["losses"] == runs["host"]["losses"] == runs["nvme"]["losses"],
        "nvme_read_bytes_per_s": io["bytes_read"] / io["read_s"] if io["read_s"] else None,
        "nvme_write_bytes_per_s": io["bytes_written"] / io["write_s"] if io["write_s"] else None,
        "nvme_bytes_per_step": (io["bytes_read"] + io["bytes_written"] - io.get("init_bytes_written", 0))
        / max(1, io["steps"]),
    }
    return out


def markdown(r: dict) -> str:
    s, g = r["summary"], 2**30
    lines = [f"## Optimizer offload tiers ({s['params'] / 1e6:.0f}M-parameter Llama, fp32, one CPU process)", "",
             r["note"] + ".", "",
             "| tier | peak RSS (GiB) | median step (s) | x in-memory |", "|---|---|---|---|"]
    for t, run in r["runs"].items():
        lines.append(f"| {t} | {run['peak_rss_bytes'] / g:.2f} | {s['median_step_s'][t]:.2f} | "
                     f"{s['step_cost_vs_memory'][t]:.2f} |")
    d = r["disk_probe"]
    lines += ["", f"- optimizer state {s['optimizer_state_bytes'] / g:.2f} GiB, prefetch buffers "
              f"{s['prefetch_buffer_bytes'] / g:.2f} GiB: RSS drop with the NVMe tier {s['rss_drop_bytes'] / g:.2f} GiB "
              f"(target >= {s['rss_drop_target_bytes'] / g:.2f} GiB: {'met' if s['rss_drop_met'] else 'NOT met'})",
              f"- per-step losses identical across tiers: {s['losses_identical']}",
              "- optimizer phase per step (CPU step + copies + disk): " + ", ".join(
                  f"{t} {run['io']['step_s'] / max(1, run['io']['steps']):.2f} s" for t, run in r["runs"].items()
                  if "io" in run) + " (the in-memory step is not timed apart)",
              f"- NVMe tier I/O: {s['nvme_bytes_per_step'] / g:.2f} GiB per step, read "
              f"{(s['nvme_read_bytes_per_s'] or 0) / g:.2f} GiB/s, write {(s['nvme_write_bytes_per_s'] or 0) / g:.2f} GiB/s "
              "(through the page cache: the files fit in free host memory here)",
              f"- disk probe ({d['directory']}): write {d['write_bytes_per_s'] / g:.2f} GiB/s to fdatasync, read "
              f"{d['read_bytes_per_s'] / g:.2f} GiB/s cache dropped, {d['read_cached_bytes_per_s'] / g:.2f} GiB/s cached",
              "", "Command: `.venv/bin/python -m benchmarks.bench_offload`", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="directory of the NVMe tier (default: the temp dir)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--markdown", action="store_true", help="rewrite offload.md from offload.json and stop")
    a = ap.parse_args()
    if a.markdown:
        (RESULTS / "offload.md").write_text(markdown(json.loads((RESULTS / "offload.json").read_text())))
        return
    if a.child:
        with tempfile.TemporaryDirectory() as logs:
            print(json.dumps(_child(a.child, a.steps, a.dir, logs)))
        return
    r = run(a.steps, a.dir, a.quick, log=lambda m: print(m, file=sys.stderr, flush=True))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "offload.json").write_text(json.dumps(r, indent=1))
    (RESULTS / "offload.md").write_text(markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
