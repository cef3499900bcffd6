"""(h) torch.compile: eager against per-block compiled training steps, side by side, compile time included.

One group of spawned gloo processes (world 2) builds, for each strategy, the same model twice
with the same plan, once eager and once with `compile` on (dtorch/parallel/compile.py), and times
them in alternating rounds (eager first in even rounds, compiled first in odd ones) so that the
machine's load drifts over both alike. Step = forward + backward + AdamW step, with a barrier on
both sides of every timed step. The first step of each side is timed apart: the compiled one
traces and generates the code (`compile_s` = first step - median step); Inductor's on-disk cache is
pointed at a fresh folder, so this is a first run's cold compile. `break_even_steps` = compile_s /
(eager - compiled step time): how many steps a run needs before compiling has paid for itself.

Each strategy's figures are also stored as a measurement under ``compile`` in the calibration of
this machine's cluster (``local:1x2``; dtorch.parallel.compile.record_measurement), where the
planner reads the measured gain and compile time (docs/design.md, "torch.compile").

    python -m benchmarks --only compile [--quick]
    python -m benchmarks.bench_compile [--quick] [--no-record]   # also writes benchmarks/results/compile.*
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any

from benchmarks import stats
from benchmarks._group import run_group

MODEL = "llama-tiny:hidden=128,heads=8,kv_heads=4,layers=4,seq=128"
SEQ = 128
GLOBAL_BATCH = 8
WORLD = 2
STRATEGIES = {  # name -> plan fields at world 2
    "FSDP": {"dp_shard": 2},
    "TP+SP": {"tp": 2, "sp": True},
}


def _build(fields: dict, compiled: bool, device):
    import dataclasses

    import torch

    from dtorch.models import build_model
    from dtorch.parallel.parallelize import parallelize
    from dtorch.plan.plan import Plan
    from dtorch.train.losses import next_token

    dp = fields.get("dp_replicate", 1) * fields.get("dp_shard", 1)
    plan = Plan(**fields, microbatch_size=GLOBAL_BATCH // dp, global_batch=GLOBAL_BATCH, seq_len=SEQ)
    if compiled:
        names = {f.name for f in dataclasses.fields(Plan)}
        if "compile" in names:
            plan = dataclasses.replace(plan, compile=True)
        else:  # before the planner's field exists: the executor reads it with getattr
            plan.compile = True
    pm = parallelize(lambda: build_model(MODEL), plan, loss_fn=next_token, device=device, seed=0, seq_len=SEQ)
    opts = [torch.optim.AdamW(p.parameters(), lr=1e-4) for p in pm.model_parts]

    def step(inputs, labels):
        pm.forward_backward(inputs, labels)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)

    return step, plan, pm


def _worker(payload: dict, rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from dtorch.models import model_config

    vocab = model_config(MODEL).vocab_size
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")

    def timed(step, x, y) -> float:
        dist.barrier()
        t = time.perf_counter()
        step(x, y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        return time.perf_counter() - t

    out: dict[str, Any] = {}
    for name in payload["strategies"]:
        fields = STRATEGIES[name]
        sides = {}
        for side in ("eager", "compiled"):
            step, plan, pm = _build(fields, side == "compiled", device)
            local = plan.local_batch()
            g = torch.Generator().manual_seed(1000 + pm.dp_rank)
            tok = torch.randint(vocab, (local, SEQ + 1), generator=g)
            x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
            sides[side] = (step, x, y)
            out.setdefault(name, {})[f"{side}_first_step_s"] = timed(step, x, y)
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for rnd in range(payload["rounds"]):
            order = ("eager", "compiled") if rnd % 2 == 0 else ("compiled", "eager")
            for side in order:
                step, x, y = sides[side]
                for _ in range(payload["steps"]):
                    times[side].append(timed(step, x, y))
        out[name].update({f"{side}_times_s": t for side, t in times.items()})
        del sides
    return out


def run(quick: bool = False, log=print, record: bool = True) -> dict[str, Any]:
    rounds, steps = (2, 3) if quick else (6, 5)
    log(f"compile: {len(STRATEGIES)} strategies x (eager, compiled) at world {WORLD}, {rounds} alternating rounds "
        f"x {steps} steps, model {MODEL}")
    t0 = time.perf_counter()
    cache = tempfile.mkdtemp(prefix="dtorch-bench-inductor-")
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # the spawned ranks inherit it: a cold compile
    try:
        out = run_group(WORLD, _worker, {"strategies": list(STRATEGIES), "rounds": rounds, "steps": steps},
                        timeout_s=900.0)
    finally:
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
    r0 = out[0]
    if "error" in r0:
        raise RuntimeError(f"compile worker failed:\n{r0['error']}")
    import torch

    from dtorch.plan.plan import Plan

    cluster = _cluster_name()
    rows = []
    for name, fields in STRATEGIES.items():
        d = r0[name]
        e, c = stats.median(d["eager_times_s"]), stats.median(d["compiled_times_s"])
        compile_s = max(0.0, d["compiled_first_step_s"] - c)
        per_round = [a / b for a, b in zip(_round_medians(d["eager_times_s"], steps),
                                           _round_medians(d["compiled_times_s"], steps))]
        row = {
            "strategy": name, "plan": fields, "eager_step_s": e, "compiled_step_s": c, "speedup": e / c,
            "speedup_min": min(per_round), "speedup_max": max(per_round),
            "compile_s": compile_s, "eager_first_step_s": d["eager_first_step_s"],
            "compiled_first_step_s": d["compiled_first_step_s"],
            "break_even_steps": compile_s / (e - c) if e > c else None,
            "eager_times_s": d["eager_times_s"], "compiled_times_s": d["compiled_times_s"],
        }
        rows.append(row)
        if record:
            from dtorch.parallel.compile import record_measurement

            record_measurement(cluster, {
                "family": Plan(**fields).family(), "plan": fields, "model": MODEL, "world_size": WORLD,
                "seq_len": SEQ, "global_batch": GLOBAL_BATCH, "param_dtype": "float32",
                "eager_step_s": e, "compiled_step_s": c, "compile_s": compile_s, "torch": torch.__version__,
                "device_kind": "cuda" if torch.cuda.is_available() else "cpu",
                "load_average": os.getloadavg()[0], "source": "benchmarks.bench_compile",
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            })
    return {"config": {"model": MODEL, "seq_len": SEQ, "global_batch": GLOBAL_BATCH, "world_size": WORLD,
                       "rounds": rounds, "steps_per_round": steps, "quick": quick, "cluster": cluster,
                       "recorded": record, "load_average_end": os.getloadavg()},
            "results": rows, "seconds": time.perf_counter() - t0}


def _round_medians(times: list[float], steps: int) -> list[float]:
    return [stats.median(times[i:i + steps]) for i in range(0, len(times), steps)]


def _cluster_name() -> str:
    from dtorch.cluster.local import local_cluster

    return local_cluster(WORLD, WORLD, calibrated=False).name


def markdown(result: dict) -> str:
    cfg = result["config"]
    lines = ["## (h) torch.compile: eager vs per-block compiled", "",
             f"World {cfg['world_size']} (gloo, 1 thread per rank), `{cfg['model']}`, global batch "
             f"{cfg['global_batch']} x seq {cfg['seq_len']}, fp32, AdamW; {cfg['rounds']} alternating rounds x "
             f"{cfg['steps_per_round']} steps per side, medians. Compile time = compiled first step - its median "
             "step, cold Inductor cache. The machine is shared with other jobs (load average "
             f"{(cfg.get('load_average_end') or [float('nan')])[0]:.1f} at the end): compare the two columns of one "
             "row, measured side by side, not across runs.", "",
             "| strategy | eager ms/step | compiled ms/step | speedup (min-max over rounds) | compile s | "
             "steps to break even |", "|---|---|---|---|---|---|"]
    for r in result["results"]:
        be = f"{r['break_even_steps']:,.0f}" if r["break_even_steps"] is not None else "never (no gain)"
        lines.append(f"| {r['strategy']} | {r['eager_step_s'] * 1e3:.1f} | {r['compiled_step_s'] * 1e3:.1f} | "
                     f"{r['speedup']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) | {r['compile_s']:.1f} | "
                     f"{be} |")
    if cfg.get("recorded"):
        lines += ["", f"Recorded under `compile` in the calibration of `{cfg['cluster']}` "
                  "(dtorch.parallel.compile.record_measurement)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    import json
    from pathlib import Path

    result = run(quick="--quick" in argv, log=lambda m: print(m, file=sys.stderr, flush=True),
                 record="--no-record" not in argv)
    out = Path(os.environ.get("DTORCH_BENCH_OUT") or Path(__file__).resolve().parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "compile.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
