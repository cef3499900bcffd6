"""Uneven work on uneven workers: 2 ranks on this machine, one really slowed to about half speed.

    .venv/bin/python -m benchmarks.bench_hetero [--steps 4] [--quota 0.5] [--quick]

Each worker is its own process with one thread. Worker 1 is slowed from outside DTorch: its
process is put in a cgroup with a CPU quota (`--quota` of one core) and the same fraction of a
process's CPU weight, so the handicap holds on a quiet machine (the quota binds) and on a busy one
(the weight does); cgroup v2 or v1's cpu controller, whichever is writable. Where no cgroup is
writable, each worker is pinned to its own core and a busy process is pinned to worker 1's. Side by side in one run, on the same global batch of `MICROBATCHES` micro-batches per
step (a small Llama, fp32, gloo):

- each worker alone (both at once, each on its core, no communication): its samples/s; the ideal
  of the pair is their sum;
- the best uniform plan: data parallelism with even shares, and a two-stage pipeline with even
  layers (the faster of the two);
- the auto plan: the planner's plan when it gives uneven `dp_shares` for the measured cluster (two
  device groups with the measured speeds), otherwise shares computed from the measured per-rank
  speeds (the JSON says which); and, for reference, the pipeline with layers apportioned by speed.

Throughput is that of the fastest timed step (other processes on a shared machine only slow
steps down); the mean over the timed steps is recorded too. Runs are repeated in `--rounds` interleaved rounds and the best of each kept; "alone" trains the
whole global batch on one worker. Targets (issue 14): auto >= 1.3x the best uniform plan and >= 85 % of the ideal. Writes
benchmarks/results/hetero.json and hetero.md. The machine may be shared: the figures of one run
are compared with each other, never with another run's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dtorch.train.rebalance import shares_from_speeds  # noqa: E402 - micro-batches by speed, as the trainer's

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=1024, max_seq_len=128)
SEQ = 128
MICROBATCHES = 24
"""Micro-batches (of one sample) per step over both ranks: enough compute per step that the
gradient all-reduce is a small part of it, and fine enough shares (24 splits 2:1 exactly)."""
TARGET_SPEEDUP, TARGET_IDEAL = 1.3, 0.85


# ---- a worker process ----------------------------------------------------------------------------
def _worker(spec: dict) -> dict:
    """One rank: join the group, apply the plan, time `steps` steps after one warm-up step.
    `spec["core"]` names the worker (1 = the slowed one) and, against a busy process, its core."""
    if spec.get("pin"):  # only against a pinned busy process; a cgroup handicap holds wherever it runs
        os.sched_setaffinity(0, {spec["core"]})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from dtorch.models.configs import LlamaConfig
    from dtorch.models.llama import Llama
    from dtorch.parallel import parallelize
    from dtorch.plan.plan import Plan
    from dtorch.train.losses import next_token
    from dtorch.train.sampler import GlobalSampler

    world, rank = spec["world"], spec["rank"]
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{spec['rdzv']}", rank=rank, world_size=world)
    plan = Plan.from_dict(spec["plan"])
    cfg = LlamaConfig(**MODEL)
    pm = parallelize(lambda: Llama(cfg), plan, loss_fn=next_token, seq_len=SEQ)
    opt = torch.optim.AdamW(list(pm.parameters()), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, MODEL["vocab_size"], (256, SEQ + 1), generator=g)
    gb = plan.microbatch_size * plan.num_microbatches * plan.dp
    sampler = GlobalSampler(len(data), gb, seed=0)
    shares = [plan.microbatch_size * n for n in plan.dp_shares] if pm.uneven else None
    times, losses = [], []
    for step in range(spec["steps"] + 1):
        idx = sampler.local_indices(step, pm.dp_rank, pm.dp_size, shares=shares)
        x = data[idx]
        if world > 1:
            dist.barrier()
        t = time.perf_counter()
        loss = pm.forward_backward(x[:, :-1], x[:, 1:])
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    steady = times[1:]
    # the fastest step: on a shared machine other processes only ever slow a step down
    return {"rank": rank, "step_s": steady, "samples_per_s": gb / min(steady),
            "mean_samples_per_s": gb * len(steady) / sum(steady), "losses": losses,
            "local_microbatches": pm.num_local_microbatches}


# ---- the slowdown --------------------------------------------------------------------------------
class Slowdown:
    """Worker 1's handicap, applied from outside: a cgroup CPU quota, else a busy process on its core."""

    def __init__(self, core: int, quota: float):
        self.core, self.quota = core, quota
        self.cgroup: Path | None = None
        self.hog: subprocess.Popen | None = None
        self.how = ""
        name = f"dtorch-bench-hetero-{os.getpid()}"
        period = 100_000
        for root, files in ((Path("/sys/fs/cgroup"), "v2"), (Path("/sys/fs/cgroup/cpu"), "v1")):
            try:
                if files == "v2" and not (root / "cgroup.controllers").is_file():
                    continue
                if files == "v1" and not (root / "cpu.cfs_quota_us").is_file():
                    continue
                path = root / name
                path.mkdir()
                if files == "v2":
                    (path / "cpu.max").write_text(f"{int(quota * period)} {period}\n")
                    # and half a normal process's weight, so that the handicap holds on a busy machine
                    # too, where the quota alone would not bind (every process gets less than it)
                    (path / "cpu.weight").write_text(f"{max(1, int(100 * quota))}\n")
                else:
                    (path / "cpu.cfs_period_us").write_text(f"{period}\n")
                    (path / "cpu.cfs_quota_us").write_text(f"{int(quota * period)}\n")
                    (path / "cpu.shares").write_text(f"{max(2, int(1024 * quota))}\n")
                self.cgroup, self.how = path, (f"cgroup {files} CPU quota {quota:.2f} of a core and "
                                               f"{quota:.2f}x a process's CPU weight")
                return
            except OSError:
                with contextlib.suppress(OSError):
                    (root / name).rmdir()
        # no writable cgroup: a competing busy process pinned to the worker's core
        self.hog = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\n"
                                     "while True: pass"])
        self.how = f"a busy process pinned to core {core} (no writable cgroup)"

    def add(self, pid: int) -> None:
        if self.cgroup is not None:
            (self.cgroup / "cgroup.procs").write_text(f"{pid}\n")

    def close(self) -> None:
        if self.hog is not None:
            self.hog.kill()
            self.hog.wait()
        if self.cgroup is not None:
            parent = self.cgroup.parent / "cgroup.procs"
            with contextlib.suppress(OSError):
                for pid in (self.cgroup / "cgroup.procs").read_text().split():
                    parent.write_text(pid + "\n")
            for _ in range(50):
                try:
                    self.cgroup.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


def _launch(specs: list[dict], slow: Slowdown) -> list[dict]:
    """Start one process per spec (worker 1's in the slowdown), wait, return their results."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i, spec in enumerate(specs):
            spec = {**spec, "rdzv": os.path.join(tmp, "rdzv"), "pin": slow.hog is not None}
            out = os.path.join(tmp, f"out{i}.json")
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
            p = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_hetero", "--worker", json.dumps(spec),
                                  "--result", out], env=env, cwd=Path(__file__).resolve().parents[1])
            if spec["core"] == slow.core:
                slow.add(p.pid)
            procs.append((p, out))
        rcs = [p.wait(timeout=900) for p, _ in procs]
        if any(rcs):
            raise RuntimeError(f"a worker failed (exit codes {rcs})")
        return [json.loads(Path(out).read_text()) for _, out in procs]


# ---- plans ---------------------------------------------------------------------------------------
def _plan(**kw) -> dict:
    from dtorch.plan.plan import Plan

    return Plan(**kw).validate().to_dict()


def planner_shares(speeds: list[float]) -> tuple[dict | None, str]:
    """The planner's plan for two device groups with the measured speeds, when it gives uneven
    dp_shares; else None and why not."""
    from dtorch.cluster.hetero import measured_cluster
    from dtorch.cluster.local import local_cluster
    from dtorch.model import profile_module
    from dtorch.models.configs import LlamaConfig
    from dtorch.models.llama import Llama
    from dtorch.plan.search import search

    try:
        # the cluster `dtorch probe --cluster-out` writes for these speeds: a group per speed class
        cluster = measured_cluster(local_cluster(2, calibrated=False), speeds)
        cfg = LlamaConfig(**MODEL)
        profile = profile_module(lambda: Llama(cfg), SEQ)
        # every run here is fp32: the comparison is of how work is apportioned, not of precision
        # (on a CPU with native bf16 the planner would also pick bf16, and beat the fp32 ideal)
        res = search(profile, cluster, global_batch=MICROBATCHES, seq_len=SEQ, dtype="float32",
                     fixed={"microbatch_size": 1, "reduce_dtype": "float32"}, top_k=1, suggest=False)
    except Exception as e:  # noqa: BLE001 - the fallback is recorded, with why
        return None, f"planner failed: {type(e).__name__}: {e}"[:300]
    if res.best is None:
        return None, "the planner found no plan"
    plan = res.best[0]
    if plan.dp_shares is None or len(set(plan.dp_shares)) < 2:
        return None, f"the planner chose {plan.describe()} (no uneven dp_shares on this branch)"
    return plan.to_dict(), f"planner: {plan.describe()}"


# ---- the run -------------------------------------------------------------------------------------
def run(steps: int = 3, quota: float = 0.5, quick: bool = False, rounds: int = 2, log=print) -> dict:
    steps, rounds = (2, 1) if quick else (steps, rounds)
    slow = Slowdown(core=1, quota=quota)
    log(f"hetero: worker 1 slowed by {slow.how}")
    try:
        def pair(plan: dict) -> dict:
            res = _launch([{"world": 2, "rank": r, "core": r, "plan": plan, "steps": steps} for r in (0, 1)], slow)
            return {"plan": plan, "samples_per_s": min(r["samples_per_s"] for r in res),
                    "mean_samples_per_s": min(r["mean_samples_per_s"] for r in res),
                    "step_s": res[0]["step_s"], "losses": res[0]["losses"],
                    "local_microbatches": [r["local_microbatches"] for r in res]}

        half = MICROBATCHES // 2
        # alone: the whole global batch on one worker (the same optimizer steps per sample as the pair)
        alone_plan = _plan(microbatch_size=1, num_microbatches=MICROBATCHES)
        uniform_plans = {
            "ddp_even": _plan(dp_replicate=2, microbatch_size=1, num_microbatches=half),
            "pp_even": _plan(pp=2, schedule="1f1b", microbatch_size=1, num_microbatches=MICROBATCHES),
        }
        best: dict[str, dict] = {}

        def keep(name: str, r: dict) -> None:
            if name not in best or r["samples_per_s"] > best[name]["samples_per_s"]:
                best[name] = r

        speeds: list[float] = []
        source, auto_doc, layers = "", None, None
        for rnd in range(rounds):  # rounds interleave the runs, so a burst of load hits them alike
            alone = _launch([{"world": 1, "rank": 0, "core": c, "plan": alone_plan, "steps": steps} for c in (0, 1)],
                            slow)
            for c, a in enumerate(alone):
                keep(f"alone{c}", {"samples_per_s": a["samples_per_s"], "mean_samples_per_s": a["mean_samples_per_s"]})
            if rnd == 0:
                speeds = [a["samples_per_s"] for a in alone]
                log(f"hetero: alone {speeds[0]:.2f} and {speeds[1]:.2f} samples/s (ratio {speeds[1] / speeds[0]:.2f})")
                auto_doc, source = planner_shares(speeds)
                if auto_doc is None:
                    shares = shares_from_speeds(speeds, MICROBATCHES)
                    auto_doc = _plan(dp_replicate=2, microbatch_size=1, num_microbatches=half, dp_shares=shares)
                    source = f"shares from the measured per-rank speeds ({source})"
                layers = shares_from_speeds(speeds, MODEL["n_layers"])
            for name, plan in uniform_plans.items():
                keep(name, pair(plan))
            keep("auto", pair(auto_doc))
            keep("pp_uneven", pair(_plan(pp=2, schedule="1f1b", microbatch_size=1, num_microbatches=MICROBATCHES,
                                         layer_partition=layers)))
            log(f"hetero: round {rnd + 1}: " + ", ".join(f"{k} {v['samples_per_s']:.2f}" for k, v in best.items()))
        speeds = [best["alone0"]["samples_per_s"], best["alone1"]["samples_per_s"]]
        ideal = sum(speeds)
        uniform = {k: best[k] for k in uniform_plans}
        auto, pp_uneven = best["auto"], best["pp_uneven"]
    finally:
        slow.close()
    best_uniform = max(uniform, key=lambda k: uniform[k]["samples_per_s"])
    sp = auto["samples_per_s"] / uniform[best_uniform]["samples_per_s"]
    frac = auto["samples_per_s"] / ideal
    return {
        "slowdown": slow.how, "steps": steps, "rounds": rounds, "microbatches_per_step": MICROBATCHES, "model": MODEL, "seq_len": SEQ,
        "alone_samples_per_s": speeds, "ideal_samples_per_s": ideal, "uniform": uniform,
        "best_uniform": best_uniform, "auto": auto, "auto_source": source, "pp_uneven": pp_uneven,
        "speedup_vs_uniform": sp, "fraction_of_ideal": frac,
        "targets": {"speedup_vs_uniform": TARGET_SPEEDUP, "fraction_of_ideal": TARGET_IDEAL},
        "met": {"speedup_vs_uniform": sp >= TARGET_SPEEDUP, "fraction_of_ideal": frac >= TARGET_IDEAL},
        "load_average": os.getloadavg(),
    }


def Plan_describe(doc: dict) -> str:  # noqa: N802 - a small helper named after what it shows
    from dtorch.plan.plan import Plan

    return Plan.from_dict(doc).describe()


def markdown(r: dict) -> str:
    lines = ["# Heterogeneous workers: uneven work (bench_hetero)", "",
             f"2 ranks, one core each; worker 1 slowed by {r['slowdown']}. Llama {r['model']}, seq {r['seq_len']}, "
             f"{r['microbatches_per_step']} micro-batches of 1 sample per step, fp32, gloo, {r['steps']} timed steps per "
             f"run, best of {r['rounds']} interleaved rounds; each worker alone trains the whole global batch. "
             f"Load average {r['load_average'][0]:.1f} at the end (the machine may be shared: compare within "
             "this run only).", "",
             "| run | plan | samples/s |", "|---|---|---|"]
    a0, a1 = r["alone_samples_per_s"]
    lines.append(f"| worker 0 alone | 1 rank | {a0:.2f} |")
    lines.append(f"| worker 1 alone (slowed) | 1 rank | {a1:.2f} |")
    lines.append(f"| ideal (sum) | | {r['ideal_samples_per_s']:.2f} |")
    for name, res in r["uniform"].items():
        best = " (best uniform)" if name == r["best_uniform"] else ""
        lines.append(f"| uniform {name}{best} | {Plan_describe(res['plan'])} | {res['samples_per_s']:.2f} |")
    lines.append(f"| **auto** | {Plan_describe(r['auto']['plan'])} | **{r['auto']['samples_per_s']:.2f}** |")
    lines.append(f"| pipeline, layers by speed | {Plan_describe(r['pp_uneven']['plan'])} | "
                 f"{r['pp_uneven']['samples_per_s']:.2f} |")
    lines += ["", f"Auto plan from: {r['auto_source']}.", "",
              "| figure | value | target | met |", "|---|---|---|---|",
              f"| auto / best uniform | {r['speedup_vs_uniform']:.2f}x | >= {TARGET_SPEEDUP}x | "
              f"{'yes' if r['met']['speedup_vs_uniform'] else '**no**'} |",
              f"| auto / ideal | {r['fraction_of_ideal'] * 100:.0f} % | >= {TARGET_IDEAL * 100:.0f} % | "
              f"{'yes' if r['met']['fraction_of_ideal'] else '**no**'} |", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_hetero", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up step)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of all runs, interleaved; the best of each is kept")
    p.add_argument("--quota", type=float, default=0.5, help="worker 1's CPU quota, a fraction of one core")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        Path(args.result).write_text(json.dumps(_worker(json.loads(args.worker))))
        return 0
    r = run(steps=args.steps, quota=args.quota, quick=args.quick, rounds=args.rounds, log=lambda m: print(m, file=sys.stderr, flush=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hetero.json").write_text(json.dumps(r, indent=1) + "\n")
    (out / "hetero.md").write_text(markdown(r))
    print(markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
