"""Monitoring overhead: the same training run with the monitor off and on, side by side.

    python -m benchmarks.bench_monitor [--quick]     # -> benchmarks/results/monitor.json, monitor.md

ONE group of 2 spawned ranks (gloo on CPU) runs `Trainer.fit` repeatedly, alternating:

- off: ``metrics_every=0``, no server (the trainer's usual rank-0 console/JSONL logging stays on);
- on:  per-rank metrics every 10 steps (communication timer, block hooks, the all_gather), the
  server on rank 0, and a client in rank 0's process that reads the page's data every 2 s and
  scrapes /metrics every 5 s (more often than Prometheus' usual 15 s; the client's own CPU is
  charged to the monitor).

Step time = rank 0's `step_time_s` from metrics.jsonl, steps after the first 5 of each fit. The
overhead is median(on) / median(off) - 1, with each repetition's pair as the spread. On a shared
machine that spread is far wider than 2 %, so the benchmark also accounts for the monitor's work
directly, a figure the noise does not move: time inside the monitor's per-step call
(`RunMonitor.step`, including the gather every N steps), plus the collectives per step times the
measured cost of the timing wrapper around one call, plus block-forward calls per step times the
measured cost of the two hooks. Communication tracing (CommDebugMode) is not part of either side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks._group import run_group

MODEL = "gpt:layers=4,hidden=128,heads=4,vocab=256,seq=128"
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
    while not stop.wait(2.0):
        try:
            urllib.request.urlopen(url + "api/data", timeout=10).read()
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
    out: dict[str, Any] = {"off": [], "on": [], "inside_s": [], "counts": [], "comm_calls_per_step": []}
    for rep in range(payload["reps"]):
        for side in (("off", "on") if rep % 2 == 0 else ("on", "off")):
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
            trainer.fit(steps=payload["steps"])
            stop.set()
            if client is not None:
                client.join(timeout=15)
            dist.barrier()
            if rank == 0:
                recs = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
                times = [r["step_time_s"] for r in recs if "event" not in r][5:]
                out[side].append(times)
                if side == "on":
                    out["inside_s"].append(inside["s"] / payload["steps"])
                    out["counts"].append(dict(counts))
                    out["comm_calls_per_step"].append(inside["calls"] / payload["steps"])
                    out["blocks"] = inside["blocks"]
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


def run(quick: bool = False, log=print) -> dict[str, Any]:
    reps, steps = (2, 25) if quick else (4, 45)
    log(f"monitor overhead: {reps} interleaved repetitions x (off, on) x {steps} steps at world 2")
    t0 = time.perf_counter()
    r0 = run_group(2, _worker, {"reps": reps, "steps": steps}, timeout_s=600)[0]
    if "error" in r0:
        raise RuntimeError(r0["error"])
    off = [statistics.median(t) for t in r0["off"]]
    on = [statistics.median(t) for t in r0["on"]]
    all_off = statistics.median([x for t in r0["off"] for x in t])
    all_on = statistics.median([x for t in r0["on"] for x in t])
    pairs = [b / a - 1.0 for a, b in zip(off, on)]
    inside = statistics.median(r0["inside_s"])
    calls = statistics.median(r0["comm_calls_per_step"])
    accounted = inside + calls * r0["wrapper_s_per_call"] + r0["blocks"] * r0["hooks_s_per_block_call"]
    return {"config": {"model": MODEL, "seq_len": SEQ, "global_batch": GLOBAL_BATCH, "world_size": 2,
                       "reps": reps, "steps_per_fit": steps, "metrics_every": 10, "quick": quick},
            "median_step_off_s": all_off, "median_step_on_s": all_on, "overhead": all_on / all_off - 1.0,
            "per_rep_overhead": pairs, "per_rep_off_s": off, "per_rep_on_s": on,
            "monitor_call_s_per_step": inside, "monitor_call_share": inside / all_on,
            "comm_calls_per_step": calls, "block_calls_per_step": r0["blocks"],
            "wrapper_s_per_call": r0["wrapper_s_per_call"], "hooks_s_per_block_call": r0["hooks_s_per_block_call"],
            "accounted_s_per_step": accounted, "accounted_share": accounted / all_off,
            "client_requests": r0["counts"], "seconds": time.perf_counter() - t0}


def markdown(r: dict) -> str:
    c = r["config"]
    pct = ", ".join(f"{100 * x:+.1f} %" for x in r["per_rep_overhead"])
    return "\n".join([
        "## Monitoring overhead (metrics + page on vs off)", "",
        f"Model `{c['model']}`, seq {c['seq_len']}, global batch {c['global_batch']}, world {c['world_size']} "
        f"(gloo, CPU), per-rank metrics every {c['metrics_every']} steps, server + a client reading the page "
        f"data every 2 s and /metrics every 5 s; {c['reps']} interleaved repetitions x {c['steps_per_fit']} steps.",
        "", "| | median step ms |", "|---|---|",
        f"| monitor off | {r['median_step_off_s'] * 1e3:.1f} |",
        f"| monitor on | {r['median_step_on_s'] * 1e3:.1f} |", "",
        f"Overhead (median on / median off - 1): **{100 * r['overhead']:+.2f} %**; per repetition: {pct}.", "",
        f"Time inside the monitor's per-step call (including the gather every {c['metrics_every']} steps): "
        f"{r['monitor_call_s_per_step'] * 1e6:.0f} us per step = {100 * r['monitor_call_share']:.2f} % of the step.",
        "",
        f"Accounted monitor work per step: that call + {r['comm_calls_per_step']:.0f} timed collectives x "
        f"{r['wrapper_s_per_call'] * 1e6:.2f} us + {r['block_calls_per_step']:.0f} block calls x "
        f"{r['hooks_s_per_block_call'] * 1e6:.2f} us = {r['accounted_s_per_step'] * 1e6:.0f} us = "
        f"**{100 * r['accounted_share']:.2f} %** of the step (the side-by-side figure above carries the "
        "noise of the machine's other load).", ""])


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
