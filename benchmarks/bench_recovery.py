"""(f) Recovery time per failure: the main job (`dtorch.train.job`, the real trainer with async
checkpoints) under `dtorch run` with a chaos drill that SIGKILLs a random worker every N steps.

Per recovery, from the launcher's event log (`<run_dir>/events.jsonl`, `dtorch.elastic.events`):
detect (fault to the agent noticing), stop (survivors stopped), rendezvous, start (workers spawned
to their first phase), replan, load (checkpoint), first step, and total (fault to the end of the
first step after it). Per run: steps executed again (fault step minus the last committed
checkpoint, read from the step log), and the effective-time ratio (the unique steps' time over the
wall time, first start included).

    python -m benchmarks --only recovery [--quick]
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL = "gpt:layers=2,hidden=64,heads=2,vocab=256,seq=64"
PHASES = ("detect", "stop", "rendezvous", "start", "replan", "load", "first_step", "total")


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def drill(steps: int, every: int, nproc: int = 2, checkpoint_every: int = 10, timeout_s: float = 900.0,
          log=print) -> dict[str, Any]:
    """One drill run; returns its recoveries and the run's figures."""
    from dtorch.elastic import events

    with tempfile.TemporaryDirectory() as d:
        run_dir, ckpt = os.path.join(d, "run"), os.path.join(d, "ckpt")
        cmd = [sys.executable, "-c", "import sys; from dtorch.cli import main; sys.exit(main())", "run",
               "--nproc-per-node", str(nproc), "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
               "--run-dir", run_dir, "--max-restarts", str(steps // every + 2),
               "--chaos", f"every={every}:kill:seed=1",
               "-m", "dtorch.train.job", "--steps", str(steps), "--checkpoint-every", str(checkpoint_every),
               "--checkpoint-dir", ckpt, "--no-progress", "--sample-tokens", "0", "--model", MODEL,
               "--seq-len", "64", "--global-batch", "8", "--plan", "dp_shard=2"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env=env, cwd=d, capture_output=True, text=True, timeout=timeout_s)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            raise RuntimeError(f"drill exited {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}")
        recs = events.recoveries(os.path.join(run_dir, events.EVENTS_FILE))
        faults = [e for e in events.read(os.path.join(run_dir, events.EVENTS_FILE)) if e["kind"] == "fault"]
        step_log = [json.loads(x) for x in Path(ckpt, "metrics.jsonl").read_text().splitlines() if x.strip()]
    step_recs = [x for x in step_log if "step" in x and "step_time_s" in x and "event" not in x]
    seen: dict[int, float] = {}
    executed = 0
    for x in step_recs:
        executed += 1
        seen[x["step"]] = x["step_time_s"]
    for x in recs:
        log("    " + events.format_recovery(x))
    return {
        "steps": steps, "every": every, "nproc": nproc, "checkpoint_every": checkpoint_every,
        "failures": len(faults), "recoveries": recs, "wall_s": wall,
        "unique_steps": len(seen), "steps_executed": executed,
        "steps_lost_per_failure": (executed - len(seen)) / len(faults) if faults else None,
        "effective_ratio": sum(seen.values()) / wall if wall > 0 else None,
    }


def run(quick: bool = False, log=print) -> dict[str, Any]:
    steps, every = (40, 15) if quick else (120, 30)
    log(f"  recovery drill: {steps} steps, a worker SIGKILLed every {every} steps, checkpoints every 10")
    res = drill(steps, every, log=log)
    recs = res["recoveries"]
    med = {k: statistics.median(x[k] for x in recs if x.get(k) is not None) if any(x.get(k) is not None for x in recs)
           else None for k in PHASES}
    return {"drill": res, "median": med, "model": MODEL}


def markdown(result: dict) -> str:
    d, med = result["drill"], result["median"]
    lines = ["## (f) Recovery per failure (main job under `dtorch run`, chaos drill)", "",
             f"`{result['model']}`, {d['nproc']} CPU workers, {d['steps']} steps, a random worker SIGKILLed every "
             f"{d['every']} steps, checkpoints every {d['checkpoint_every']}: {d['failures']} failures, "
             f"{len(d['recoveries'])} recoveries; steps executed again per failure "
             f"{d['steps_lost_per_failure'] if d['steps_lost_per_failure'] is None else round(d['steps_lost_per_failure'], 1)}; "
             f"useful step time / wall time {d['effective_ratio']:.2f} (wall {d['wall_s']:.0f} s, first start included).",
             "", "| recovery | " + " | ".join(PHASES) + " |", "|---" * (len(PHASES) + 1) + "|"]
    for i, r in enumerate(d["recoveries"], 1):
        lines.append(f"| {i} | " + " | ".join("-" if r.get(k) is None else f"{r[k]:.2f}" for k in PHASES) + " |")
    lines.append("| median | " + " | ".join("-" if med.get(k) is None else f"{med[k]:.2f}" for k in PHASES) + " |")
    return "\n".join(lines) + "\n\nSeconds. `total` is fault to the end of the first step after it.\n"


if __name__ == "__main__":
    print(markdown(run(quick="--quick" in sys.argv)))
