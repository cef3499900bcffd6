"""Monitoring overhead: the same training run with the monitor off and on, side by side; and the
exposed communication share the monitor reports for a TP plan, next to torch's profiler.

    python -m benchmarks.bench_monitor [--quick]     # -> benchmarks/results/monitor.json, monitor.md

Overhead. ONE group of 2 spawned ranks (gloo on CPU) runs short `Trainer.fit`s in rounds:

- off: ``metrics_every=0``, no server (the trainer's usual rank-0 console/JSONL logging stays on);
- on:  per-rank metrics every 10 steps (communication timer, block hooks, the all_gather), the
  server on rank 0, and a client in rank 0's process that reads the page's data every 2 s as the
  page does (the steps after the last it holds) and scrapes /metrics every 5 s (more often than
  Prometheus' usual 15 s; the client's own CPU is charged to the monitor).

One warm-up fit is discarded; then each round runs an off and an on fit back to back, in
alternating order (off-on, on-off, ...), so that the machine's load, which drifts over tens of
seconds on a shared host, is nearly the same for both halves of a round. Per fit, the first steps
are dropped and the median kept, for two clocks: rank 0's wall step time (`step_time_s`) and rank
0's process CPU time per step (all its threads: the server and the client included), which other
processes' load moves much less. (The fastest tenth of each fit's wall steps was tried as a
load-robust wall figure: at load 11-16 its spread over rounds was 36 points against the median's 8.) The overhead is the median over rounds of on / off - 1, with
the rounds' interquartile range as the spread. The benchmark also accounts for the monitor's work
directly: time inside the monitor's per-step call (`RunMonitor.step`, including the gather every N
steps), plus the collectives per step times the measured cost of the timing wrapper around one
call, plus block-forward calls per step times the measured cost of the two hooks. Communication
tracing (CommDebugMode) is not part of either side. The 1-min load average is recorded at the
start, after every fit and at the end.

Page polls of a long run. A fit of 24 steps cannot show what a poll costs after 20,000 steps;
`poll_costs` times it directly (the whole history vs the steps since the page's last poll).

Communication share. `dtorch train --nproc 4 --plan tp=4` on a tiny model with
``DTORCH_PROFILE_COMMS=1``: per rank, the ``ranks`` record's comm_tp / step next to the profiler's
exposed communication / step over the same steps (`dtorch.monitor.commprofile`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks._group import run_group

MODEL = "gpt:layers=4,hidden=128,heads=4,vocab=256,seq=128"
TP_MODEL = "gpt:layers=2,hidden=64,heads=4,vocab=256,seq=64"
SEQ = 128
GLOBAL_BATCH = 16
RESULTS = Path(__file__).resolve().parent / "results"


def _client(log_dir: Path, stop: threading.Event, counts: dict) -> None:
    info = log_dir / "monitor.json"
    while not info.exists() and not stop.is_set():
        time.sleep(0.1)
    if stop.is_set():
        return
    url = json.loads(info.read_text())["url"]
    last_scrape = 0.0
    since = session = None
    while not stop.wait(2.0):
        try:
            # as the page polls: the steps after the last one it holds
            q = f"?since={since}&session={session}" if session is not None and since is not None else ""
            d = json.loads(urllib.request.urlopen(url + "api/data" + q, timeout=10).read())
            session, since = d["session"], (d["steps"][-1]["step"] if d["steps"] else since)
            counts["page"] += 1
            if time.time() - last_scrape >= 5.0:
                urllib.request.urlopen(url + "metrics", timeout=10).read()
                counts["scrape"] += 1
                last_scrape = time.time()
        except OSError:
            pass


def _worker(payload: dict, rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dtorch.models import build_model
    from dtorch.monitor import live
    from dtorch.plan.plan import Plan
    from dtorch.train.optim import AdamW
    from dtorch.train.trainer import Trainer

    inside = {"s": 0.0, "calls": 0, "blocks": 0.0}
    orig = live.RunMonitor.step

    def timed(self, *a, **k):  # the monitor's own per-step work, timed
        t = time.perf_counter()
        try:
            return orig(self, *a, **k)
        finally:
            inside["s"] += time.perf_counter() - t
            inside["calls"] = self.comm.calls if self.comm is not None else 0
            inside["blocks"] = len(self._handles) / 2

    live.RunMonitor.step = timed
    from dtorch.monitor.metrics import MetricsLogger

    cpu_marks: list[float] = []
    orig_log = MetricsLogger.log

    def log_step(self, m):  # rank 0's process CPU clock at the end of every step (all threads)
        cpu_marks.append(time.process_time())
        return orig_log(self, m)

    MetricsLogger.log = log_step
    out: dict[str, Any] = {"off": [], "on": [], "off_cpu": [], "on_cpu": [], "inside_s": [], "counts": [],
                           "comm_calls_per_step": [], "load": []}
    sides = [("warmup", "off")] + [(r, side) for r in range(payload["rounds"])
                                   for side in (("off", "on") if r % 2 == 0 else ("on", "off"))]
    drop = payload["drop"]
    for rnd, side in sides:
        tmp = Path(tempfile.mkdtemp(prefix=f"dtorch-bench-monitor-{side}-"))
        log_dir = tmp / f"rank{rank}"
        plan = Plan(dp_replicate=world, microbatch_size=GLOBAL_BATCH // world, num_microbatches=1,
                    param_dtype="float32", global_batch=GLOBAL_BATCH, seq_len=SEQ)
        trainer = Trainer(model=lambda: build_model(MODEL), optimizer=AdamW(lr=1e-3), global_batch=GLOBAL_BATCH,
                          seq_len=SEQ, plan=plan, log_dir=log_dir, console=False,
                          metrics_every=10 if side == "on" else 0, monitor_port=0 if side == "on" else None)
        stop, counts = threading.Event(), {"page": 0, "scrape": 0}
        client = None
        if side == "on" and rank == 0:
            client = threading.Thread(target=_client, args=(log_dir, stop, counts), daemon=True)
            client.start()
        inside["s"] = 0.0
        cpu_marks.clear()
        trainer.fit(steps=payload["steps"])
        stop.set()
        if client is not None:
            client.join(timeout=15)
        dist.barrier()
        if rank == 0 and rnd != "warmup":
            recs = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
            times = [r["step_time_s"] for r in recs if "event" not in r][drop:]
            cpu = [b - a for a, b in zip(cpu_marks, cpu_marks[1:])][drop - 1:]
            out[side].append(times)
            out["load"].append(os.getloadavg()[0])
            out[f"{side}_cpu"].append(cpu)
            if side == "on":
                out["inside_s"].append(inside["s"] / payload["steps"])
                out["counts"].append(dict(counts))
                out["comm_calls_per_step"].append(inside["calls"] / payload["steps"])
                out["blocks"] = inside["blocks"]
    MetricsLogger.log = orig_log
    if rank == 0:
        out.update(_unit_costs())
    return out


def _unit_costs(n: int = 20000) -> dict[str, float]:
    """Seconds the timing wrapper adds to one collective call, and the two hooks to one block call."""
    import torch

    from dtorch.monitor.comms import CommTimer

    def collective(tensor, op=None, group=None, async_op=False):
        return None

    wrapped = CommTimer()._wrap_c10d(collective)
    x = torch.zeros(1)

    def per_call(fn, arg=x) -> float:
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(n):
                fn(arg)
            best = min(best, (time.perf_counter() - t) / n)
        return best

    wrap_cost = max(0.0, per_call(wrapped) - per_call(collective))
    lin, v = torch.nn.Identity(), torch.zeros(1)  # a block whose forward costs nothing: the hooks are all
    plain = per_call(lin, v)
    state = {"t": 0.0, "s": 0.0}
    lin.register_forward_pre_hook(lambda m, a: state.__setitem__("t", time.perf_counter()))
    lin.register_forward_hook(lambda m, a, o: state.__setitem__("s", state["s"] + time.perf_counter() - state["t"]))
    hook_cost = max(0.0, per_call(lin, v) - plain)
    return {"wrapper_s_per_call": wrap_cost, "hooks_s_per_block_call": hook_cost}


def poll_costs(steps: int = 20000, new: int = 20, repeats: int = 5) -> dict[str, float]:
    """Seconds one page poll holds the rank-0 process (the server's thread, under the GIL the
    training loop needs) after `steps` steps: the whole history, and only the `new` steps since the
    page's last poll (what the page asks for). Best of `repeats`; no training runs."""
    from dtorch.monitor.server import MonitorState

    st = MonitorState(None)
    for i in range(1, steps + 1):
        st.feed({"step": i, "loss": 4.0, "grad_norm": 1.0, "lr": 1e-3, "step_time_s": 0.1, "tokens_per_s": 1e4,
                 "mfu": 0.01, "peak_memory_bytes": 2**30, "world_size": 2, "epoch": 0, "t": 1.0, "eta_s": 60.0})

    def best(**kw) -> float:
        out = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            json.dumps(st.data(**kw), default=str).encode()
            out = min(out, time.perf_counter() - t)
        return out

    return {"steps": steps, "new_steps": new, "full_s": best(),
            "incremental_s": best(since=steps - new, session=st.session)}


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def comm_share(quick: bool = False) -> dict[str, Any]:
    """TP at world 4: the monitor's exposed comm share per rank vs torch's profiler, same steps."""
    import subprocess
    import sys

    every = 3 if quick else 5
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "dtorch.cli", "train", "--nproc", "4", "--model", TP_MODEL, "--seq-len", "64",
               "--global-batch", "4", "--steps", str(2 * every), "--checkpoint-dir", str(run_dir),
               "--checkpoint-every", "1000", "--sample-tokens", "0", "--plan", "tp=4", "--metrics-every", str(every),
               "--no-progress", "--max-restarts", "0"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "DTORCH_PROFILE_COMMS": "1"})
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-3000:])
        recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rec = [r for r in recs if r.get("event") == "ranks"][-1]
        rows = []
        for r in rec["ranks"]:
            prof = json.loads((run_dir / f"comm-profile-rank{r['rank']}.json").read_text())
            share, ref = r["comm_tp"] / r["step"], prof["exposed_s_per_step"] / r["step"]
            rows.append({"rank": r["rank"], "step_s": r["step"], "monitor_comm_tp_share": share,
                         "profiler_exposed_share": ref, "profiler_flight_share": prof["flight_s_per_step"] / r["step"],
                         "other_axes_s": sum(r[f"comm_{a}"] for a in ("dp_replicate", "dp_shard", "cp", "pp", "other")),
                         "rel_diff": share / ref - 1.0})
    return {"model": TP_MODEL, "plan": "tp=4", "world_size": 4, "steps_compared": f"{every + 1}..{2 * every}",
            "ranks": rows, "max_abs_rel_diff": max(abs(x["rel_diff"]) for x in rows)}


def run(quick: bool = False, log=print) -> dict[str, Any]:
    rounds, steps, drop = (3, 14, 4) if quick else (12, 24, 4)
    log(f"monitor overhead: 1 warm-up fit + {rounds} rounds x (off, on, alternating order) x {steps} steps "
        f"at world 2")
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    r0 = run_group(2, _worker, {"rounds": rounds, "steps": steps, "drop": drop}, timeout_s=900)[0]
    if "error" in r0:
        raise RuntimeError(r0["error"])
    off = [statistics.median(t) for t in r0["off"]]
    on = [statistics.median(t) for t in r0["on"]]
    off_cpu = [statistics.median(t) for t in r0["off_cpu"]]
    on_cpu = [statistics.median(t) for t in r0["on_cpu"]]
    wall = [b / a - 1.0 for a, b in zip(off, on)]
    cpu = [b / a - 1.0 for a, b in zip(off_cpu, on_cpu)]
    all_off = statistics.median([x for t in r0["off"] for x in t])
    all_on = statistics.median([x for t in r0["on"] for x in t])
    inside = statistics.median(r0["inside_s"])
    calls = statistics.median(r0["comm_calls_per_step"])
    accounted = inside + calls * r0["wrapper_s_per_call"] + r0["blocks"] * r0["hooks_s_per_block_call"]
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    polls = poll_costs()
    log("communication share vs the profiler: TP at world 4")
    comm = comm_share(quick)
    return {"config": {"model": MODEL, "seq_len": SEQ, "global_batch": GLOBAL_BATCH, "world_size": 2,
                       "rounds": rounds, "steps_per_fit": steps, "dropped_steps_per_fit": drop, "metrics_every": 10,
                       "quick": quick, "cpus": os.cpu_count(), "load_avg_1min_at_end": load,
                       "load_avg_1min_at_start": load0, "load_avg_1min_per_fit": r0["load"]},
            "page_poll": polls,
            "median_step_off_s": all_off, "median_step_on_s": all_on,
            "overhead": statistics.median(wall), "overhead_iqr": _quartiles(wall), "per_round_overhead": wall,
            "cpu_overhead": statistics.median(cpu), "cpu_overhead_iqr": _quartiles(cpu), "per_round_cpu_overhead": cpu,
            "median_cpu_per_step_off_s": statistics.median(off_cpu), "median_cpu_per_step_on_s": statistics.median(on_cpu),
            "monitor_call_s_per_step": inside, "monitor_call_share": inside / all_on,
            "comm_calls_per_step": calls, "block_calls_per_step": r0["blocks"],
            "wrapper_s_per_call": r0["wrapper_s_per_call"], "hooks_s_per_block_call": r0["hooks_s_per_block_call"],
            "accounted_s_per_step": accounted, "accounted_share": accounted / all_off,
            "client_requests": r0["counts"], "comm_share": comm, "seconds": time.perf_counter() - t0}


def markdown(r: dict) -> str:
    c = r["config"]
    pct = ", ".join(f"{100 * x:+.1f} %" for x in r["per_round_overhead"])
    pct_cpu = ", ".join(f"{100 * x:+.1f} %" for x in r["per_round_cpu_overhead"])
    iq, iqc = r["overhead_iqr"], r["cpu_overhead_iqr"]
    load = c.get("load_avg_1min_at_end")
    cm = r["comm_share"]
    lines = [
        "## Monitoring overhead (metrics + page on vs off)", "",
        f"Model `{c['model']}`, seq {c['seq_len']}, global batch {c['global_batch']}, world {c['world_size']} "
        f"(gloo, CPU), per-rank metrics every {c['metrics_every']} steps, server + a client reading the page "
        f"data every 2 s and /metrics every 5 s; a warm-up fit, then {c['rounds']} rounds of (off, on) fits in "
        f"alternating order, {c['steps_per_fit']} steps each, the first {c['dropped_steps_per_fit']} dropped.",
        "", f"Machine: {c['cpus']} CPUs, shared with other jobs (1-min load average {c['load_avg_1min_at_start']:.1f} "
        f"at the start, {min(c['load_avg_1min_per_fit']):.1f}-{max(c['load_avg_1min_per_fit']):.1f} during the fits, "
        f"{load:.1f} at the end; the step is ~{r['median_cpu_per_step_off_s'] * 1e3:.0f} ms of CPU, so a wall step "
        f"far above it means other processes had the cores)" if load is not None else "", "",
        "| | off | on | overhead: median over rounds (IQR) |", "|---|---|---|---|",
        f"| rank 0 wall step, ms | {r['median_step_off_s'] * 1e3:.1f} | {r['median_step_on_s'] * 1e3:.1f} | "
        f"**{100 * r['overhead']:+.2f} %** ({100 * iq[0]:+.1f} .. {100 * iq[1]:+.1f} %) |",
        f"| rank 0 process CPU per step, ms | {r['median_cpu_per_step_off_s'] * 1e3:.1f} | "
        f"{r['median_cpu_per_step_on_s'] * 1e3:.1f} | **{100 * r['cpu_overhead']:+.2f} %** "
        f"({100 * iqc[0]:+.1f} .. {100 * iqc[1]:+.1f} %) |", "",
        f"Per round, wall: {pct}; CPU: {pct_cpu}.", "",
        "The wall median is the figure for a quiet machine; under load, other processes decide much "
        "of it and the CPU time is the one to read.", "",
        f"Time inside the monitor's per-step call (including the gather every {c['metrics_every']} steps): "
        f"{r['monitor_call_s_per_step'] * 1e6:.0f} us per step = {100 * r['monitor_call_share']:.2f} % of the step.",
        "",
        f"Accounted monitor work per step: that call + {r['comm_calls_per_step']:.0f} timed collectives x "
        f"{r['wrapper_s_per_call'] * 1e6:.2f} us + {r['block_calls_per_step']:.0f} block calls x "
        f"{r['hooks_s_per_block_call'] * 1e6:.2f} us = {r['accounted_s_per_step'] * 1e6:.0f} us = "
        f"**{100 * r['accounted_share']:.2f} %** of the step (no other process's load in this figure).", "",
        f"One page poll after {r['page_poll']['steps']:,} steps (the server's thread, under the GIL the training "
        f"loop needs): the whole history {r['page_poll']['full_s'] * 1e3:.1f} ms, the "
        f"{r['page_poll']['new_steps']} steps since the page's last poll (what it asks for) "
        f"{r['page_poll']['incremental_s'] * 1e3:.2f} ms; every 2 s that is "
        f"{100 * r['page_poll']['full_s'] / 2:.2f} % vs **{100 * r['page_poll']['incremental_s'] / 2:.3f} %** of the "
        "wall time.", "",
        "## Exposed communication share: the monitor vs torch's profiler", "",
        f"`{cm['model']}`, plan {cm['plan']} at world {cm['world_size']} (gloo), steps {cm['steps_compared']}: "
        "the `ranks` record's comm_tp / step and, over the same steps, the profiler's union of the training "
        "thread's communication ops / step (`DTORCH_PROFILE_COMMS=1`).", "",
        "| rank | step ms | monitor comm_tp share | profiler exposed share | profiler in-flight share | difference |",
        "|---|---|---|---|---|---|"]
    for x in cm["ranks"]:
        lines.append(f"| {x['rank']} | {x['step_s'] * 1e3:.0f} | {100 * x['monitor_comm_tp_share']:.1f} % | "
                     f"{100 * x['profiler_exposed_share']:.1f} % | {100 * x['profiler_flight_share']:.1f} % | "
                     f"{100 * x['rel_diff']:+.1f} % |")
    lines += ["", f"Largest difference: **{100 * cm['max_abs_rel_diff']:.1f} %** (must hold: within 25 %).", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_monitor")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    r = run(quick=args.quick)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "monitor.json").write_text(json.dumps(r, indent=1))
    (RESULTS / "monitor.md").write_text(markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
