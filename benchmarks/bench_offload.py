"""Memory tiers of the optimizer on this machine: peak RSS and step time of a ~310M-parameter
Llama trained in memory, with the host tier and with the NVMe tier (state and fp32 masters in
files), each tier with its step after the backward and overlapped with it, against the planner's
prediction; plus the disk bandwidth the NVMe tier reached and the disk probe's figures (the probe
and the tier move their blocks through the same huge-page buffers, `dtorch.cluster.disk.aligned_buffer`:
with 4 KiB pages the request sizes, and so this VM disk's rate, were a draw per set of buffers, and
the tier's step had run at up to 2x the probe's rate).

    .venv/bin/python -m benchmarks.bench_offload [--steps 7] [--dir /local/nvme/tmp] [--quick]

Each run is its own process (its peak RSS is its own), one after the other, with the same optimizer
kernel (torch's fused CPU AdamW) and no gradient clipping (so the overlap applies) so the step
times compare tiers, not kernels. Before and after each tier's child trains, the parent measures what the planner prices the
tier with (the mean is priced) (`dtorch.cluster.host`: CPU AdamW parameters/s; the copy bandwidth; the disk
probe), under the same load, and reports the planner's prediction from those figures beside its
own. On a CPU machine "device" and "host" are the same memory: the host tier *adds* its fp32
masters there, the NVMe tier removes the optimizer state. Writes benchmarks/results/offload.json
and offload.md.
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

from benchmarks.stats import mean_tree

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = dict(dim=1024, n_layers=26, n_heads=16, n_kv_heads=4, vocab_size=8192, max_seq_len=256)
SEQ = 32
RUNS = ("none", "host", "nvme")
"""In-memory, the host tier, the NVMe tier. A tier's run alternates its steps between the step after
the backward (odd steps, the first one a warm-up) and the step overlapped with it (even steps), so
the two are compared under the same load."""


def _probe(directory: str, quick: bool) -> dict:
    """What the planner prices the tiers with, measured now: CPU AdamW parameters/s (both kernels),
    the copy bandwidth (the cost model's memory bandwidth on a CPU), the disk."""
    import torch

    from dtorch.cluster.disk import measure_disk
    from dtorch.cluster.host import measure_host_optimizer
    from dtorch.cluster.probe import measure_memory_bandwidth

    t = 0.1 if quick else 0.5
    return {"host_optimizer": measure_host_optimizer(min_time=t),  # 16M params: 256 MiB of state, beyond the L3
            "memory_bandwidth": measure_memory_bandwidth(torch.device("cpu"), min_time=t)["bytes_per_s"],
            "disk": measure_disk(directory, nbytes=(128 if quick else 1024) * 2**20)}


def predict(tier: str, probe: dict, overlap: bool, params_on_disk: bool, fb_s: float | None = None) -> dict:
    """The planner's seconds per step for the optimizer phase of `tier` on one CPU rank calibrated
    with `probe`: the estimate's exposed offload term, and `tier_terms`' parts. With the overlap the
    term hides behind the backward as long as the planner thinks the backward is; its CPU compute
    is not calibrated here (no GEMM probe: it puts this step's forward+backward near 30 s against
    under 2 s measured), so `fb_s`, the measured forward+backward without the overlap, stands in
    for its compute: the overlap rule is checked, not the compute model."""
    from dtorch.cluster.calibration_store import CALIBRATION_VERSION, apply_calibration
    from dtorch.cluster.local import local_cluster
    from dtorch.model import profile_module
    from dtorch.models.configs import LlamaConfig
    from dtorch.models.llama import Llama
    from dtorch.plan.cost import estimate, step_shape, with_constants
    from dtorch.plan.plan import Plan
    from dtorch.plan.strategies.base import RankShare
    from dtorch.plan.strategies.memory import MEMORY, STATE_BYTES
    from dtorch.plan.strategies.pipeline import distinct_loads

    cluster = local_cluster(1, calibrated=False, workload=(MODEL["dim"], MODEL["n_heads"], SEQ))
    doc = {"version": CALIBRATION_VERSION, "device_kind": cluster.groups[0].device.kind,
           "device": {"memory_bandwidth": probe["memory_bandwidth"]},
           "host_optimizer": probe["host_optimizer"], "disk": probe["disk"]}
    cluster = apply_calibration(cluster, doc)
    profile = profile_module(lambda: Llama(LlamaConfig(**MODEL)), SEQ)
    plan = Plan(microbatch_size=1, offload={"host": "optimizer", "nvme": "optimizer_nvme"}[tier])
    consts = with_constants(grad_clipping=not overlap, cpu_adam_fused=True)
    est = estimate(plan, profile, cluster, constants=consts)
    step = step_shape(plan, profile, cluster, constants=consts)
    load = distinct_loads(plan, profile.num_layers)[0]
    p_local = step.p_stage(load) / step.fs
    per_param = STATE_BYTES + (4.0 if params_on_disk else 0.0)
    terms = MEMORY.tier_terms(step, load, p_local, per_param)
    offload = est.time_breakdown["offload"]
    if params_on_disk or fb_s is not None:  # the plan's NVMe tier keeps the masters in host memory;
        # this run does not: the same term with 12 B/param on disk (one micro-batch)
        br = est.time_breakdown
        share = RankShare(compute=br["compute"] if fb_s is None else fb_s, recompute=br["recompute"])
        offload = MEMORY.offload_time(step, load, p_local, share, per_param)
    return {"offload_s": offload, "terms": terms, "step_s": est.step_time_s, "host_bytes": est.host_bytes_per_rank}


def _child(run: str, steps: int, directory: str, log_dir: str, quick: bool) -> dict:
    import torch

    from dtorch.models.configs import LlamaConfig
    from dtorch.models.llama import Llama
    from dtorch.plan.plan import Plan
    from dtorch.train.offload import OptimizerOffload
    from dtorch.train.optim import AdamW
    from dtorch.train.trainer import Trainer

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tier = run
    offload = {"none": None, "host": OptimizerOffload("host"),
               "nvme": OptimizerOffload("nvme", directory=directory, params_on_disk=True)}[tier]
    cfg = LlamaConfig(**MODEL)
    tr = Trainer(model=lambda: Llama(cfg), plan=Plan(microbatch_size=1), global_batch=1, seq_len=SEQ,
                 optimizer=AdamW(lr=1e-4, fused=True), offload=offload or "none", console=False, straggler_every=0,
                 metrics_every=0, log_dir=log_dir, max_grad_norm=None)
    per_step: list[dict] = []
    build = tr._build_optimizers

    def build_timed():  # (fit() builds the model and the optimizer: their phases are timed from here)
        opts = build()
        opt, fb = opts[0], tr.parallel.forward_backward
        ov = getattr(opt, "_overlap", None)
        if ov is not None:
            ov.enabled = False  # step 1 after the backward; then on, off, on, ...
        last = dict(getattr(opt, "stats", {}))
        if hasattr(opt, "io_stats"):
            last.update({k: v for k, v in opt.io_stats().items() if k in ("read_s", "write_s")})

        def timed_fb(*a, **k):
            t = time.perf_counter()
            out = fb(*a, **k)
            per_step.append({"fb_s": time.perf_counter() - t, "overlap": bool(ov is not None and ov.enabled)})
            return out

        def pre(*a):
            per_step[-1]["t_opt"] = time.perf_counter()

        def post(*a):
            rec = per_step[-1]
            rec["opt_s"] = time.perf_counter() - rec.pop("t_opt")
            stats = dict(getattr(opt, "stats", {}))
            if hasattr(opt, "io_stats"):  # the disk threads' busy seconds (read, write) this step
                stats.update({k: v for k, v in opt.io_stats().items() if k in ("read_s", "write_s")})
            for key in ("copy_s", "kernel_s", "in_backward", "read_s", "write_s"):
                if key in stats:
                    rec[key] = stats[key] - last.get(key, 0)
            last.update(stats)
            if ov is not None:
                ov.enabled = len(per_step) % 2 == 1  # the next step's mode

        tr.parallel.forward_backward = timed_fb
        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(post)
        return opts

    tr._build_optimizers = build_timed
    res = tr.fit(steps)
    times = []
    for line in Path(log_dir, "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "step_time_s" in rec and rec.get("step") is not None:
            times.append(rec["step_time_s"])
    for rec, t in zip(per_step, times):
        rec["step_s"] = t
    out = {"run": run, "tier": tier, "params": sum(p.numel() for p in tr.parallel.parameters()),
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "steps": per_step, "losses": [res.losses[s] for s in sorted(res.losses)]}
    opt0 = tr.optimizers[0]
    if hasattr(opt0, "io_stats"):
        out["io"] = opt0.io_stats()
        out["memory"] = opt0.memory()
        out["blocks"] = len(opt0.blocks)
        opt0.close()
    return out


def _median(v: list[float]) -> float:
    """The median (of an even count, the mean of the middle two)."""
    if not v:
        return float("nan")
    v, n = sorted(v), len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def _mode(r: dict, overlap: bool | None, key: str) -> float:
    """The median of `key` over the steps after the first (warm-up) in one mode (None: all). (A
    second `_median` used to drop the first value again, so with 7 steps each mode's "median" was
    the larger of its last two steps.)"""
    return _median([s[key] for s in r["steps"][1:] if key in s and (overlap is None or s["overlap"] == overlap)])


def run(steps: int = 7, directory: str | None = None, quick: bool = False, log=print) -> dict:
    from dtorch.cluster.disk import measure_disk

    steps = 3 if quick else steps
    base = Path(directory or tempfile.gettempdir())
    out: dict = {"model": MODEL, "steps": steps, "directory": str(base), "cpu_count": os.cpu_count(),
                 "load_average": os.getloadavg(),
                 "note": "measured on a 2-core machine shared with other sessions: step times are noisy (compare "
                         "ratios of one run), the RSS figures are per process and not affected"}
    out["disk_probe"] = measure_disk(base, nbytes=(128 if quick else 1024) * 2**20)
    runs = {}
    for name in RUNS:
        with tempfile.TemporaryDirectory(dir=base) as work:
            t = time.perf_counter()
            cmd = [sys.executable, "-m", "benchmarks.bench_offload", "--child", name, "--steps", str(steps),
                   "--dir", work] + (["--quick"] if quick else [])
            # the planner's figures, probed here (not in the child: its peak RSS stays its own), just
            # before and just after the child trains, under the load it trained under
            before = _probe(work, quick) if name != "none" else None
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
            if proc.returncode:
                raise RuntimeError(f"{name} run failed:\n{proc.stderr[-3000:]}")
            runs[name] = json.loads(proc.stdout.strip().splitlines()[-1])
            if before is not None:
                probe = {"before": before, "after": _probe(work, quick)}
                probe["mean"] = mean_tree(probe["before"], probe["after"])  # the load moves
                runs[name]["probe"] = probe
                fb_off = _mode(runs[name], False, "fb_s")
                runs[name]["predicted"] = {mode: predict(name, probe["mean"], mode == "on", params_on_disk=name == "nvme",
                                                         fb_s=fb_off if mode == "on" else None)
                                           for mode in ("off", "on")}
            log(f"offload {name}: peak RSS {runs[name]['peak_rss_bytes'] / 2**30:.2f} GiB, "
                f"{time.perf_counter() - t:.0f} s")
    out["runs"] = runs
    out["load_average_after"] = os.getloadavg()
    return summarize(out)


def summarize(out: dict) -> dict:
    """`out["summary"]` from the runs' per-step records and predictions (`--markdown` recomputes it
    from offload.json)."""
    runs = out["runs"]
    n = runs["none"]["params"]
    states = 8 * n  # AdamW: exp_avg + exp_avg_sq in float32
    buf = runs["nvme"]["memory"]["buffer_bytes"]
    drop = runs["none"]["peak_rss_bytes"] - runs["nvme"]["peak_rss_bytes"]
    io = runs["nvme"]["io"]
    tiers = {}
    for name, r in runs.items():
        if "io" not in r:
            continue
        for mode, ov in (("off", False), ("on", True)):
            pred = r["predicted"][mode]
            # what the tier adds to the step: off, the step() after the backward; on, what step()
            # has left after it plus what the backward grew by (the worker shares its cores, and on
            # a CPU that is where the planner prices the overlapped work)
            measured = _mode(r, ov, "opt_s")
            if ov:
                measured += _mode(r, True, "fb_s") - _mode(r, False, "fb_s")
            tiers[f"{name}_{mode}"] = {
                "measured_optimizer_s": measured, "predicted_optimizer_s": pred["offload_s"],
                "ratio": measured / pred["offload_s"],
                "within_25pct": abs(measured / pred["offload_s"] - 1) <= 0.25,
                "measured_copy_s": _mode(r, ov, "copy_s"), "predicted_copy_s": pred["terms"]["copies_s"],
                "measured_kernel_s": _mode(r, ov, "kernel_s"), "predicted_kernel_s": pred["terms"]["kernel_s"],
                "predicted_disk_s": pred["terms"]["disk_s"],
                "measured_read_s": _mode(r, ov, "read_s") if r.get("io", {}).get("mode") else 0.0,
                "measured_write_s": _mode(r, ov, "write_s") if r.get("io", {}).get("mode") else 0.0,
                "blocks_stepped_in_backward": _mode(r, ov, "in_backward"), "blocks": r["blocks"],
                "median_fb_s": _mode(r, ov, "fb_s"), "median_step_s": _mode(r, ov, "step_s"),
            }
    host = runs["host"]["probe"]["mean"]
    out["summary"] = {
        "params": n, "optimizer_state_bytes": states, "prefetch_buffer_bytes": buf,
        "rss_drop_bytes": drop, "rss_drop_target_bytes": states - buf, "rss_drop_met": drop >= states - buf,
        "median_step_s": {"none": _mode(runs["none"], None, "step_s"),
                          **{t: x["median_step_s"] for t, x in tiers.items()}},
        "tiers": tiers,
        "overlap_gain": {t: tiers[f"{t}_off"]["median_step_s"] / tiers[f"{t}_on"]["median_step_s"]
                         for t in ("host", "nvme")},
        "probe_host": {"adam_fused_params_per_s": host["host_optimizer"]["adam_fused_params_per_s"],
                       "copy_bytes_per_s": host["host_optimizer"]["copy_bytes_per_s"]},
        "losses_identical": len({json.dumps(r["losses"]) for r in runs.values()}) == 1,
        "nvme_read_bytes_per_s": io["bytes_read"] / io["read_s"] if io["read_s"] else None,
        "nvme_write_bytes_per_s": io["bytes_written"] / io["write_s"] if io["write_s"] else None,
        "nvme_bytes_per_step": (io["bytes_read"] + io["bytes_written"] - io.get("init_bytes_written", 0))
        / max(1, io["steps"]),
        "nvme_mode": io.get("mode"),
        "probe_disk": {t: runs[t]["probe"]["mean"]["disk"] for t in ("nvme",) if "probe" in runs[t]},
    }
    return out


def markdown(r: dict) -> str:
    s, g = r["summary"], 2**30
    lines = [f"## Optimizer offload tiers ({s['params'] / 1e6:.0f}M-parameter Llama, fp32, one CPU process, "
             "fused CPU AdamW, no clipping)", "",
             r["note"] + f"; load average {r['load_average'][0]:.1f} before, {r['load_average_after'][0]:.1f} after.", "",
             "| run | overlap | peak RSS (GiB) | median step (s) | forward+backward (s) |", "|---|---|---|---|---|"]
    for t, run in r["runs"].items():
        for mode, ov in ((None, None),) if t == "none" else (("off", False), ("on", True)):
            lines.append(f"| {t} | {mode or '-'} | {run['peak_rss_bytes'] / g:.2f} | {_mode(run, ov, 'step_s'):.2f} | "
                         f"{_mode(run, ov, 'fb_s'):.2f} |")
    lines += ["", "What the tier adds to the step (overlap off: the time `step()` takes after the backward; on: what "
              "`step()` has left after the backward plus what the backward grew by, the median forward+backward "
              "with the overlap minus without), measured against the planner's exposed offload term from the "
              "figures probed just before and after the child trained (their mean); the parts (medians of the "
              "steps, each part timed where it runs: copies and AdamW on the stepping thread, the disk as the "
              "reader's and the writer's busy seconds, in flight at once; predicted: the probe's cycle of both). "
              "With the overlap on, the planner's window (2/3 of the backward) is taken from the measured "
              "forward+backward with the overlap off: the planner's CPU compute is not calibrated here (no GEMM "
              "probe), so the rows check the overlap rule, not the compute model:", "",
              "| run | measured (s) | predicted (s) | measured / predicted | copies meas. / pred. (s) | "
              "CPU AdamW meas. / pred. (s) | disk: reader, writer busy / pred. (s) | blocks stepped in backward |",
              "|---|---|---|---|---|---|---|---|"]
    for t, x in s["tiers"].items():
        ok = " (within 25 %)" if x["within_25pct"] else " (**outside 25 %**)"
        lines.append(f"| {t} | {x['measured_optimizer_s']:.2f} | {x['predicted_optimizer_s']:.2f} | "
                     f"{x['ratio']:.2f}{ok} | {x['measured_copy_s']:.2f} / {x['predicted_copy_s']:.2f} | "
                     f"{x['measured_kernel_s']:.2f} / {x['predicted_kernel_s']:.2f} | "
                     f"{x.get('measured_read_s', 0.0):.2f}, {x.get('measured_write_s', 0.0):.2f} / "
                     f"{x['predicted_disk_s']:.2f} | "
                     f"{x['blocks_stepped_in_backward']:.0f} of {x['blocks']} |")
    d = r["disk_probe"]
    h = s["probe_host"]
    lines += ["", f"- probed in the host run: fused CPU AdamW {h['adam_fused_params_per_s'] / 1e6:,.0f} M "
              f"params/s, host copies {h['copy_bytes_per_s'] / 1e9:.1f} GB/s (read + write)",
              "- overlap (step of each block during the backward), whole step off / on, alternate steps of one "
              "process: " + ", ".join(f"{t} {v:.2f}x" for t, v in s["overlap_gain"].items())
              + " (on a CPU the worker thread shares the backward's cores: the planner prices no gain from the "
              "copies and AdamW there, only from the disk, a device of its own, working during the backward)",
              f"- optimizer state {s['optimizer_state_bytes'] / g:.2f} GiB, prefetch buffers "
              f"{s['prefetch_buffer_bytes'] / g:.2f} GiB: RSS drop with the NVMe tier {s['rss_drop_bytes'] / g:.2f} GiB "
              f"(target >= {s['rss_drop_target_bytes'] / g:.2f} GiB: {'met' if s['rss_drop_met'] else 'NOT met'})",
              f"- per-step losses identical across all runs: {s['losses_identical']}",
              f"- NVMe tier I/O: {s['nvme_bytes_per_step'] / g:.2f} GiB per step, read "
              f"{(s['nvme_read_bytes_per_s'] or 0) / g:.2f} GiB/s, write {(s['nvme_write_bytes_per_s'] or 0) / g:.2f} GiB/s "
              f"({s.get('nvme_mode') or '?'} I/O, `dtorch.cluster.disk.TierFile`: the page cache holds none of it; "
              "reads and writes in flight at once, each timed on its own thread)",
              f"- disk probe before the runs ({d['directory']}, the tier's own calls, {d.get('mode', '?')} I/O, "
              f"{d.get('chunk_bytes', 0) / 2**20:.0f} MiB per call, " + (
                  f"reaching the disk as requests of {d['request_bytes'] / 2**20:.1f} MiB, "
                  if d.get("request_bytes") else "") +
              f"the tier's buffers: huge pages {d.get('huge_pages') or '?'}): write {d['write_bytes_per_s'] / g:.2f} GiB/s, "
              f"read {d['read_bytes_per_s'] / g:.2f} GiB/s, read and written back at once (the tier's cycle) "
              f"{d.get('read_write_bytes_per_s', 0) / g:.2f} GiB/s each way; the planner priced the tier with the "
              "mean of the probes just before and after it trained: " + ", ".join(
                  f"{t} write {x['write_bytes_per_s'] / g:.2f}, read {x['read_bytes_per_s'] / g:.2f}, cycle "
                  f"{x.get('read_write_bytes_per_s', 0) / g:.2f} GiB/s" for t, x in s.get("probe_disk", {}).items()),
              "", "Command: `.venv/bin/python -m benchmarks.bench_offload`", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=7, help="1 warm-up, then overlap on and off in turn")
    ap.add_argument("--dir", default=None, help="directory of the NVMe tier (default: the temp dir)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--markdown", action="store_true", help="rewrite offload.md from offload.json and stop")
    a = ap.parse_args()
    if a.markdown:
        r = summarize(json.loads((RESULTS / "offload.json").read_text()))
        (RESULTS / "offload.json").write_text(json.dumps(r, indent=1))
        (RESULTS / "offload.md").write_text(markdown(r))
        return
    if a.child:
        with tempfile.TemporaryDirectory() as logs:
            print(json.dumps(_child(a.child, a.steps, a.dir, logs, a.quick)))
        return
    r = run(a.steps, a.dir, a.quick, log=lambda m: print(m, file=sys.stderr, flush=True))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "offload.json").write_text(json.dumps(r, indent=1))
    (RESULTS / "offload.md").write_text(markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
