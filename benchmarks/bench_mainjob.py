"""The main job against a hand-written PyTorch loop, side by side, and the precision it picked.

    python -m benchmarks.bench_mainjob            # writes benchmarks/results/mainjob.json and .md
    python -m benchmarks.bench_mainjob --quick

One run, on this machine, with no probe calibration (DTORCH_NO_CALIBRATION=1, a fresh capability
cache, so the prediction is the one a new user gets):

1. `dtorch train` with its defaults (2 CPU workers, the auto plan) for `steps` steps; its step
   time is the median of metrics.jsonl after warm-up, its prediction the plan's `predicted`.
2. A plain single-process loop of the same model, batch and sequence (AdamW, the default
   byte corpus's shapes) in float32 and in bfloat16 autocast, timed in alternation; each
   dtype's step time is the median of its rounds.

Reported: predicted / measured step time of the main job (target [0.67, 1.5]); the main job's step
over the hand loop's in the plan's dtype (target <= 1.10); whether the plan's dtype is the faster
one on this CPU (bfloat16 native or not: the flags are recorded); the wall time of the whole
`dtorch train` command (target < 3 minutes with setup on a fresh clone).
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

RESULTS = Path(__file__).resolve().parent / "results"


def _main_job(steps: int, log) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "DTORCH_NO_CALIBRATION": "1", "DTORCH_CAPABILITY_CACHE": str(Path(tmp) / "cap.json"),
               "DTORCH_CALIBRATION_DIR": str(Path(tmp) / "cal")}
        ckpt = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "dtorch.cli", "train", "--checkpoint-dir", str(ckpt), "--steps", str(steps),
               "--no-progress", "--sample-tokens", "0"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"dtorch train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        events = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_t = [e["step_time_s"] for e in events if "event" not in e and "step_time_s" in e]
    plan = next(e for e in events if e.get("event") == "plan")
    warm = steps_t[5:] or steps_t
    measured = statistics.median(warm)
    log(f"main job: {plan['plan']} predicted {plan['predicted_step_time_s']:.3f} s, measured {measured:.3f} s")
    return {"plan": plan["plan"], "predicted_step_time_s": plan["predicted_step_time_s"],
            "measured_step_time_s": measured, "steps": len(steps_t), "wall_s": wall}


def _hand_loop(rounds: int, log) -> dict[str, float]:
    """A plain PyTorch training loop of the main job's model and batch, per dtype (median step)."""
    import torch

    from dtorch.models import build_model
    from dtorch.train.job import DEFAULT_MODEL

    torch.manual_seed(0)
    batch, seq = 16, 128
    model = build_model(DEFAULT_MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    x = torch.randint(0, 256, (batch, seq + 1))

    def step(dtype: str) -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    for d in times:
        for _ in range(3):
            step(d)  # warm-up
    for _ in range(rounds):
        for d in times:
            times[d].append(step(d))
    out = {d: statistics.median(t) for d, t in times.items()}
    log(f"hand loop: float32 {out['float32']:.3f} s, bfloat16 {out['bfloat16']:.3f} s")
    return out


def run(quick: bool = False, log=print) -> dict[str, Any]:
    from dtorch.cluster.capability import cpu_dtype_support

    steps = 40 if quick else 80
    job = _main_job(steps, log)
    hand = _hand_loop(10 if quick else 30, log)
    dtype = "bfloat16" if "bf16" in job["plan"] else "float32"
    faster = min(hand, key=hand.get)
    ratio = job["measured_step_time_s"] / hand[dtype]
    pred = job["predicted_step_time_s"] / job["measured_step_time_s"]
    return {
        "cpu_support": cpu_dtype_support(),
        "cores": os.cpu_count(),
        "main_job": job,
        "hand_loop_step_time_s": hand,
        "plan_dtype": dtype,
        "faster_dtype": faster,
        "picked_faster_precision": dtype == faster or abs(hand["float32"] / hand["bfloat16"] - 1) < 0.05,
        "main_over_hand": ratio,
        "predicted_over_measured": pred,
        "targets": {"main_over_hand": 1.10, "predicted_over_measured": [0.67, 1.5]},
    }


def markdown(r: dict[str, Any]) -> str:
    j, h = r["main_job"], r["hand_loop_step_time_s"]
    return "\n".join([
        "## Main job vs a hand-written loop",
        "",
        f"CPU: {r['cores']} cores, bfloat16 {r['cpu_support']['bfloat16']}, float16 {r['cpu_support']['float16']} "
        "(from the kernel's flags); no probe calibration.",
        "",
        "| | step s |",
        "|---|---|",
        f"| main job `{j['plan']}` (2 workers), measured | {j['measured_step_time_s']:.3f} |",
        f"| main job, predicted before any probe | {j['predicted_step_time_s']:.3f} |",
        f"| hand loop float32 (1 process) | {h['float32']:.3f} |",
        f"| hand loop bfloat16 autocast (1 process) | {h['bfloat16']:.3f} |",
        "",
        f"- main job / hand loop in the plan's dtype ({r['plan_dtype']}): **{r['main_over_hand']:.2f}** (target <= 1.10)",
        f"- predicted / measured: **{r['predicted_over_measured']:.2f}** (target 0.67-1.5)",
        f"- plan dtype {r['plan_dtype']}, faster dtype here {r['faster_dtype']}: "
        f"{'picked the faster precision' if r['picked_faster_precision'] else 'picked the SLOWER precision'}",
        f"- `dtorch train` wall time for {j['steps']} steps: {j['wall_s']:.0f} s",
        "",
    ])


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_mainjob")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    r = run(quick=args.quick, log=lambda m: print(m, file=sys.stderr, flush=True))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "mainjob.json").write_text(json.dumps(r, indent=2) + "\n")
    (RESULTS / "mainjob.md").write_text(markdown(r))
    print(markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
