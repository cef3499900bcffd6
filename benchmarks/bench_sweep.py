"""(a) Plan sweep: every feasible plan the planner emits for a reference model at world size 2 and 4
on this machine, measured against its prediction.

All plans of one world size run inside ONE group of spawned processes; each plan is built, warmed
up, timed and torn down in turn, repetitions are interleaved (plan order reversed every other
repetition, so slow drifts of a shared machine hit all plans alike); a plan's step time is the median
step of its least disturbed repetition (other jobs on a shared machine only ever add time).
Step time is barrier to barrier on rank 0 (the slowest rank bounds it); memory is the growth of
the peak resident set of the fullest rank while the plan is built and stepped (CPU) or the CUDA
allocator peak (GPU), compared with the predicted model memory (parameters, gradients, optimizer
states, activations, buffers: the prediction without its fixed per-process margin).

    python -m benchmarks --only sweep [--quick]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import stats
from benchmarks._group import peak_rss, reset_peak_rss, run_group

MODEL = "llama-tiny:hidden=128,heads=8,kv_heads=4,layers=4,seq=128"
SEQ = 128
GLOBAL_BATCH = 8


def _worker(payload: dict, rank: int, world: int) -> dict:
    """Run `payload["tasks"]` ((repetition, plan index) pairs) in order on this rank. Each finished
    task is appended to ``state_dir/rank<r>.jsonl`` at once, so that a group that dies keeps what it
    measured. A plan that raises on this rank ends the process: its peers may be blocked in a
    collective with it, and a gloo group does not recover from a half-finished collective, so the
    runner starts a fresh group without that plan (see `_run_tasks`)."""
    import gc
    import json
    import os

    import torch
    import torch.distributed as dist

    from dtorch.models import build_model, model_config
    from dtorch.parallel.parallelize import parallelize
    from dtorch.plan.plan import Plan
    from dtorch.train.losses import next_token

    spec, seq = payload["model"], payload["seq"]
    vocab = model_config(spec).vocab_size
    plans = [Plan.from_dict(d) for d in payload["plans"]]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    state = open(os.path.join(payload["state_dir"], f"rank{rank}.jsonl"), "a", buffering=1)  # noqa: SIM115
    warmed: set[int] = set()
    for k, (rep, i) in payload["tasks"]:
        plan = plans[i]
        base = reset_peak_rss()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        times: list[float] = []
        mem = None
        try:
            pm = parallelize(lambda: build_model(spec), plan, loss_fn=next_token, device=device, seed=0,
                             seq_len=seq)
            opts = [torch.optim.AdamW(p.parameters(), lr=1e-4) for p in pm.model_parts]
            g = torch.Generator().manual_seed(1000 + pm.dp_rank)
            x = torch.randint(vocab, (plan.local_batch(), seq + 1), generator=g)
            inputs, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()

            def step(pm=pm, opts=opts, inputs=inputs, labels=labels):
                pm.forward_backward(inputs, labels)
                for o in opts:
                    o.step()
                    o.zero_grad(set_to_none=True)

            for _ in range(payload["warmup"] + (0 if i in warmed else 1)):
                step()
            for _ in range(payload["steps"]):
                dist.barrier()
                t = time.perf_counter()
                step()
                if cuda:
                    torch.cuda.synchronize(device)
                dist.barrier()
                times.append(time.perf_counter() - t)
            if i not in warmed:
                mem = (torch.cuda.max_memory_allocated(device) if cuda else peak_rss()) - base
            warmed.add(i)
            del pm, opts, step
        except Exception as e:  # noqa: BLE001 - recorded; the runner restarts the group without this plan
            msg = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            state.write(json.dumps({"task": k, "plan": i, "error": msg}) + "\n")
            state.close()
            os._exit(3)
        state.write(json.dumps({"task": k, "plan": i, "rep": rep, "times": times, "mem": mem}) + "\n")
        if rank == 0 and payload.get("progress"):
            print(f"    rep {rep + 1} plan {i + 1}/{len(plans)} {plan.describe()}: "
                  f"{statistics.median(times) * 1e3:.0f} ms", flush=True)
        gc.collect()
    state.close()
    return {"ok": True}


def _run_tasks(world: int, payload: dict, tasks: list[tuple[int, int]], log=print,
               worker=None) -> tuple[dict, dict]:
    """Run the (rep, plan) tasks in groups of `world` processes, restarting a fresh group without
    a plan that broke one. Returns (per-plan records from every rank, {plan index: error})."""
    import json
    import tempfile
    from pathlib import Path

    records: dict[int, list[dict]] = {}
    failed: dict[int, str] = {}
    pos = 0
    restarts = 0
    while pos < len(tasks):
        todo = [(k, t) for k, t in enumerate(tasks) if k >= pos and t[1] not in failed]
        if not todo:
            break
        with tempfile.TemporaryDirectory() as state_dir:
            try:
                run_group(world, worker or _worker, {**payload, "tasks": todo, "state_dir": state_dir},
                          timeout_s=payload.get("timeout_s", 120.0))
            except Exception as e:  # noqa: BLE001 - a plan broke the group; see below which one
                restarts += 1
                log(f"    group ended early ({type(e).__name__}); restarting without the failing plan")
            per_rank = []
            for r in range(world):
                f = Path(state_dir, f"rank{r}.jsonl")
                per_rank.append([json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else [])
        done_by_all = None
        for recs in per_rank:
            ks = {x["task"] for x in recs if "error" not in x}
            done_by_all = ks if done_by_all is None else done_by_all & ks
        for recs in per_rank:
            for x in recs:
                if x["task"] in done_by_all:
                    records.setdefault(x["plan"], []).append(x)
        missing = [k for k, _ in todo if k not in done_by_all]
        if not missing:
            break
        k0 = missing[0]
        i0 = tasks[k0][1]
        errs = [x["error"] for recs in per_rank for x in recs if x.get("task") == k0 and "error" in x]
        # the root cause is the rank that raised first; peers only report the connection it closed
        root = [e for e in errs if "Connection closed" not in e and "Timed out" not in e]
        failed[i0] = (root or errs or ["the group died without a message (crash or hang)"])[0]
        log(f"    plan {i0 + 1} failed: {failed[i0][:160]}")
        pos = k0 + 1
    return records, failed


def _model_memory(pred: dict) -> float:
    b = pred["memory_breakdown"]
    return float(sum(v for k, v in b.items() if k != "margin"))


def sweep_world(model: str, seq: int, global_batch: int, world: int, *, quick: bool, reps: int, steps: int,
                log=print) -> dict[str, Any]:
    """Search, run and compare every plan at one world size; returns the section dict."""
    from dtorch.cluster import local_cluster
    from dtorch.model import profile_module
    from dtorch.models import build_model
    from dtorch.plan.cost import estimate
    from dtorch.plan.search import search

    cluster = local_cluster(world)
    raw = local_cluster(world, calibrated=False)
    t0 = time.perf_counter()
    profile = profile_module(lambda: build_model(model), seq)
    res = search(profile, cluster, global_batch=global_batch, seq_len=seq, top_k=100_000, dtype="float32",
                 suggest=False)
    search_s = time.perf_counter() - t0
    ranked = list(res.ranked)
    if quick:
        keep = [ranked[0]] + [pe for fam, pe in res.best_by_family.items() if pe[0] is not ranked[0][0]]
        ranked = sorted(keep[:8], key=lambda pe: pe[1].step_time_s)
    plans = []
    for p, e in ranked:
        p.predicted = {"step_time_s": e.step_time_s, "memory_bytes_per_rank": e.memory_bytes_per_rank,
                       "memory_breakdown": dict(e.memory_breakdown), "time_breakdown": dict(e.time_breakdown)}
        plans.append(p)
    log(f"  world {world}: {len(plans)} plans (of {len(res.ranked)} feasible) on {cluster.describe()}; "
        f"running {reps} interleaved repetitions x {steps} steps")
    # plans the executor rejects up front (the same verdict on every rank) are not run
    from dtorch.parallel.check import check_plan, model_dims
    from dtorch.parallel.cp import check_cp
    from dtorch.parallel.parallelize import meta_model

    meta = meta_model(lambda: build_model(model))
    dims = model_dims(meta)
    failed: dict[int, str] = {}
    for i, p in enumerate(plans):
        try:
            check_plan(p, dims, seq_len=seq, world_size=world)
            check_cp(p, meta)
        except Exception as e:  # noqa: BLE001 - ConfigError from the executor's checks
            failed[i] = f"{type(e).__name__}: {str(e)[:300]}"
    runnable = [i for i in range(len(plans)) if i not in failed]
    tasks = []
    for rep in range(reps):
        tasks += [(rep, i) for i in (runnable if rep % 2 == 0 else runnable[::-1])]
    t1 = time.perf_counter()
    payload = {"model": model, "seq": seq, "plans": [p.to_dict() for p in plans], "steps": steps, "warmup": 1,
               "progress": True}
    records, run_failed = _run_tasks(world, payload, tasks, log=log)
    failed.update(run_failed)
    run_s = time.perf_counter() - t1
    rows = []
    for i, p in enumerate(plans):
        err = failed.get(i)
        recs = records.get(i, [])
        # step time: rank 0's barrier-to-barrier times (all ranks agree to within the barrier); the
        # plan's time is its least disturbed repetition (the median of that repetition's steps)
        by_rep: dict[int, list[float]] = {}
        for r in recs:
            by_rep.setdefault(r["rep"], []).append(r["times"])
        rep_medians = [stats.median(reps_times[0]) for reps_times in by_rep.values() if reps_times[0]]
        t = [x for reps_times in by_rep.values() for x in reps_times[0]]
        mems = [r["mem"] for r in recs if r.get("mem") is not None]
        raw_est = estimate(p, res.profile, raw, "float32")
        rows.append({
            "plan": p.describe(), "family": p.family(),
            "predicted_step_time_s": p.predicted["step_time_s"],
            "uncalibrated_predicted_step_time_s": raw_est.step_time_s,
            "measured_step_time_s": min(rep_medians) if rep_medians and not err else None,
            "measured_step_times_s": t,
            "measured_rep_medians_s": rep_medians,
            "predicted_time_breakdown": p.predicted["time_breakdown"],
            "predicted_memory_bytes": p.predicted["memory_bytes_per_rank"],
            "predicted_model_memory_bytes": _model_memory(p.predicted),
            "measured_memory_bytes": max(mems) if mems and not err else None,
            "error": err,
            "plan_doc": p.to_dict(),
        })
    summary = {
        "world_size": world, "cluster": cluster.name, "calibrated": bool(cluster.calibration.get("version")),
        "plans_feasible": len(res.ranked), "plans_run": len(rows),
        **score(rows),
        "search_s": search_s, "run_s": run_s,
    }
    return {"summary": summary, "plans": rows}


def repetition_spread(rows: list[dict]) -> dict[str, float] | None:
    """How disturbed the machine was while the plans ran: per plan, its slowest repetition's median
    step over its fastest's; the median and 90th percentile over the plans (None: fewer than two
    repetitions). On a quiet machine about 1.2 and 1.4 here; a plan's measured time is its fastest
    repetition's, so the larger the spread, the more that choice is a draw."""
    spreads = sorted(max(r["measured_rep_medians_s"]) / min(r["measured_rep_medians_s"]) for r in rows
                     if len(r.get("measured_rep_medians_s") or []) > 1 and min(r["measured_rep_medians_s"]) > 0)
    if not spreads:
        return None
    return {"median": statistics.median(spreads), "p90": spreads[min(len(spreads) - 1, int(0.9 * len(spreads)))]}


def score(rows: list[dict]) -> dict[str, Any]:
    """Rank correlation, MAPE and regret of the predictions in `rows` against their measurements."""
    ok = [r for r in rows if r["measured_step_time_s"] is not None]
    pred = [r["predicted_step_time_s"] for r in ok]
    meas = [r["measured_step_time_s"] for r in ok]
    rawp = [r["uncalibrated_predicted_step_time_s"] for r in ok]
    memok = [r for r in ok if r["measured_memory_bytes"]]
    chosen = min(ok, key=lambda r: r["predicted_step_time_s"])["plan"] if ok else None
    for r in rows:
        r["chosen"] = r["plan"] == chosen
    return {
        "plans_failed": len(rows) - len(ok),
        "chosen": chosen,
        "spearman": stats.spearman(pred, meas) if len(ok) > 1 else None,
        "mape": stats.mape(pred, meas) if ok else None,
        "regret": stats.regret(pred, meas) if ok else None,
        "uncalibrated_spearman": stats.spearman(rawp, meas) if len(ok) > 1 else None,
        "uncalibrated_mape": stats.mape(rawp, meas) if ok else None,
        "memory_spearman": stats.spearman([r["predicted_model_memory_bytes"] for r in memok],
                                          [r["measured_memory_bytes"] for r in memok]) if len(memok) > 1 else None,
        "memory_mape": stats.mape([r["predicted_model_memory_bytes"] for r in memok],
                                  [max(1, r["measured_memory_bytes"]) for r in memok]) if memok else None,
        "best_measured": min(ok, key=lambda r: r["measured_step_time_s"])["plan"] if ok else None,
        # where the error lives: measured / predicted step time by strategy family (median)
        "ratio_by_family": {fam: stats.median([r["measured_step_time_s"] / r["predicted_step_time_s"]
                                               for r in ok if r["family"] == fam])
                            for fam in sorted({r["family"] for r in ok})},
    }


def repredict(sec: dict, cal: dict | None, seq: int) -> list[dict]:
    """The plans of a sweep section re-predicted by the current cost model with calibration `cal`
    (None: the one stored now); copies of its rows, measurements kept."""
    from dtorch.cluster import local_cluster
    from dtorch.cluster.calibration_store import calibration_path, write_calibration
    from dtorch.model import profile_module
    from dtorch.models import build_model
    from dtorch.plan.cost import estimate
    from dtorch.plan.plan import Plan

    world = sec["summary"]["world_size"]
    with tempfile.TemporaryDirectory() as tmp:
        env = os.environ.get("DTORCH_CALIBRATION_DIR")
        if cal:
            os.environ["DTORCH_CALIBRATION_DIR"] = tmp
            write_calibration(cal, calibration_path(cal["cluster"]))
        try:
            cluster = local_cluster(world)
        finally:
            if env is None:
                os.environ.pop("DTORCH_CALIBRATION_DIR", None)
            else:
                os.environ["DTORCH_CALIBRATION_DIR"] = env
    raw = local_cluster(world, calibrated=False)
    prof = profile_module(lambda m=sec["model"]: build_model(m), seq)
    rows = []
    for r in sec["plans"]:
        p = Plan.from_dict(r["plan_doc"])
        rows.append({**r, "predicted_step_time_s": estimate(p, prof, cluster, "float32").step_time_s,
                     "uncalibrated_predicted_step_time_s": estimate(p, prof, raw, "float32").step_time_s})
    return rows


CALIBRATIONS = ("before", "after", "bracket", "now")
"""Which calibration `rescore` predicts with: the probe right before the world's sweep (what a user
who probes and then trains gets), the one right after it, their mean (the machine's figures over
the sweep: the probe's drift between runs is no longer counted as the model's error), or the one
stored now."""


def section_calibration(sec: dict, which: str) -> dict | None:
    """A section's calibration `which` (CALIBRATIONS); None where the sweep did not measure it."""
    before, after = sec.get("calibration"), sec.get("calibration_after")
    if which == "before":
        return before
    if which == "after":
        return after
    if which == "bracket":
        return stats.mean_tree(before, after) if before and after else None
    return None


def without(doc: dict, path: list[str]) -> dict:
    """A copy of `doc` without the field at `path` (keys, outermost first); unchanged where absent."""
    if not path or not isinstance(doc, dict) or path[0] not in doc:
        return doc
    if len(path) == 1:
        return {k: v for k, v in doc.items() if k != path[0]}
    return {**doc, path[0]: without(doc[path[0]], path[1:])}


def rescore(result: dict, log=print, calibration: str = "before", drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """The stored measurements of a sweep result re-predicted by the current cost model and one of
    the calibrations the sweep measured around each world (`run(probe=True)`, CALIBRATIONS; "now",
    or one the sweep lacks: the one stored now): for changes to the model between runs. The sweep's
    own figures are the ones measured with the model of its day. `drop`: calibration fields left
    out, dotted (``attention``, ``links.intra.sync_skew``), to see one measurement's part in the
    error on the same run."""
    out = []
    for sec in result["results"]:
        world = sec["summary"]["world_size"]
        cal = section_calibration(sec, calibration)
        for path in drop if cal else ():
            cal = without(cal, path.split("."))
        rows = repredict(sec, cal, result["config"]["seq_len"])
        s = score(rows)
        log(f"world {world} ({calibration}): Spearman {s['spearman']:.3f}, regret {s['regret']:.3f}, "
            f"MAPE {s['mape']:.1%}; chosen {s['chosen']}, best measured {s['best_measured']}")
        out.append({"model": sec["model"], "world_size": world, **s, "plans": rows})
    return {"results": out}


def repetitions(world: int, quick: bool) -> int:
    """Interleaved repetitions per plan: the world-2 section is cheap (43 plans, ~2 min at 3), so it
    runs 6, halving the share of a repetition disturbed by the machine; world 4 (98 plans) runs 3."""
    return 2 if quick else (6 if world <= 2 else 3)


def run(quick: bool = False, models: list[str] | None = None, worlds: tuple[int, ...] = (2, 4),
        probe: bool = False, log=print) -> dict[str, Any]:
    """The sweep for each model and world size. Returns {"config", "results": [{model, summary, plans}]}.

    `probe`: run `dtorch probe` at each world size right before its sweep (into the calibration
    directory the planner reads) and keep the calibration in the section, so the prediction is made
    on what the machine measured minutes, not a quarter of an hour, before the run, and `--rescore`
    can re-predict with the calibration of the day; and probe again right after it, scoring the
    predictions of the two probes' mean as well (`bracketed`): the machine drifts by more between
    two quiet probes minutes apart than the model errs (docs/benchmarks.md), and the mean is the
    machine over the sweep."""
    steps = 2
    results = []
    for model in models or [MODEL]:
        for world in worlds:
            cal = None
            if probe:
                from dtorch.cluster.probe import run_probe

                log(f"probe world {world}")
                cal, _ = run_probe(world, quick=quick)
            log(f"sweep {model} world {world}")
            sec = sweep_world(model, SEQ, GLOBAL_BATCH, world, quick=quick, reps=repetitions(world, quick),
                              steps=steps, log=log)
            sec = {"model": model, **sec, "calibration": cal}
            if probe:  # and right after it: the mean of the two is the machine over the sweep
                log(f"probe world {world} (after its sweep)")
                sec["calibration_after"], _ = run_probe(world, quick=quick)
                rows = repredict(sec, section_calibration(sec, "bracket"), SEQ)
                sec["bracketed"] = {k: v for k, v in score(rows).items()}
                for r, b in zip(sec["plans"], rows):
                    r["predicted_bracketed_step_time_s"] = b["predicted_step_time_s"]
            results.append(sec)
    return {"config": {"models": models or [MODEL], "seq_len": SEQ, "global_batch": GLOBAL_BATCH,
                       "worlds": list(worlds), "reps": {str(w): repetitions(w, quick) for w in worlds},
                       "steps_per_rep": steps, "quick": quick, "probed_before_each_world": probe},
            "results": results}


def _f(x, fmt="{:.3f}"):
    return "n/a" if x is None else fmt.format(x)


def _reps(config: dict) -> str:
    reps = config["reps"]
    return ", ".join(f"{n} at world {w}" for w, n in reps.items()) if isinstance(reps, dict) else str(reps)


def markdown(result: dict) -> str:
    lines = ["## (a) Plan sweep: predicted vs measured", "",
             f"Model `{result['config']['models'][0]}`, seq {result['config']['seq_len']}, global batch "
             f"{result['config']['global_batch']}, {_reps(result['config'])} interleaved repetitions x "
             f"{result['config']['steps_per_rep']} steps; a plan's step time is the median of its least disturbed "
             "repetition." + (" Each world size was probed (`dtorch probe --nproc N`) right before its sweep; the "
                              "predictions use that calibration." if result['config'].get('probed_before_each_world')
                              else ""), "",
             "| model | world | plans run (feasible) | failed | Spearman | MAPE | regret | Spearman uncal. | MAPE uncal. "
             "| memory Spearman | memory MAPE | planner's choice | best measured |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        s = r["summary"]
        lines.append(f"| {r['model'].split(':')[0]} | {s['world_size']} | {s['plans_run']} ({s['plans_feasible']}) | "
                     f"{s['plans_failed']} | {_f(s['spearman'])} | {_f(s['mape'], '{:.1%}')} | "
                     f"{_f(s['regret'], '{:.3f}')} | {_f(s['uncalibrated_spearman'])} | "
                     f"{_f(s['uncalibrated_mape'], '{:.1%}')} | {_f(s['memory_spearman'])} | "
                     f"{_f(s['memory_mape'], '{:.1%}')} | {s['chosen']} | {s['best_measured']} |")
    if any(r.get("bracketed") for r in result["results"]):
        lines += ["", "The same measurements predicted with the mean of the probes right before and right after each "
                  "world's sweep (the machine over the sweep; a probe alone drifts with the machine's load):", "",
                  "| world | Spearman | MAPE | regret | planner's choice |", "|---|---|---|---|---|"]
        for r in result["results"]:
            b = r.get("bracketed")
            if b:
                lines.append(f"| {r['summary']['world_size']} | {_f(b['spearman'])} | {_f(b['mape'], '{:.1%}')} | "
                             f"{_f(b['regret'], '{:.3f}')} | {b['chosen']} |")
    for r in result["results"]:
        spread = repetition_spread(r["plans"])
        if spread:
            lines += ["", f"World {r['summary']['world_size']}, the machine's disturbance while the plans ran (a "
                      "plan's slowest repetition over its fastest, over the plans): median "
                      f"{spread['median']:.2f}x, 90th percentile {spread['p90']:.2f}x"]
    for r in result["results"]:
        fams = r["summary"].get("ratio_by_family") or {}
        if fams:
            lines += ["", f"World {r['summary']['world_size']}, measured / predicted step time by family (median): "
                      + ", ".join(f"{k} {v:.1f}x" for k, v in fams.items())]
    for r in result["results"]:
        lines += ["", f"### world {r['summary']['world_size']}: every plan (predicted order)", "",
                  "| plan | predicted ms | measured ms | ratio | pred. model MiB | measured MiB | note |",
                  "|---|---|---|---|---|---|---|"]
        for p in r["plans"]:
            m = p["measured_step_time_s"]
            ratio = m / p["predicted_step_time_s"] if m else None
            mm = p["measured_memory_bytes"]
            lines.append(f"| {p['plan']}{' **(chosen)**' if p['chosen'] else ''} | "
                         f"{p['predicted_step_time_s'] * 1e3:.1f} | {_f(m and m * 1e3, '{:.1f}')} | "
                         f"{_f(ratio, '{:.2f}')} | {p['predicted_model_memory_bytes'] / 2**20:.1f} | "
                         f"{_f(mm and mm / 2**20, '{:.1f}')} | {p['error'] or ''} |")
    return "\n".join(lines) + "\n"


# ---- what the error is made of -----------------------------------------------------------------------
def _count_worker(payload: dict, rank: int, world: int) -> dict:
    """Per plan: the aten and c10d ops one training step dispatches on this rank (after a warm-up
    step), counted with a TorchDispatchMode. Same task/record protocol as `_worker`."""
    import contextlib
    import gc
    import json
    import os
    from collections import Counter

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from dtorch.models import build_model, model_config
    from dtorch.parallel.parallelize import parallelize
    from dtorch.plan.plan import Plan
    from dtorch.train.losses import next_token

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n[func._schema.name.split("::")[0]] += 1
            return func(*args, **(kwargs or {}))

    spec, seq = payload["model"], payload["seq"]
    vocab = model_config(spec).vocab_size
    plans = [Plan.from_dict(d) for d in payload["plans"]]
    state = open(os.path.join(payload["state_dir"], f"rank{rank}.jsonl"), "a", buffering=1)  # noqa: SIM115
    for k, (rep, i) in payload["tasks"]:
        plan = plans[i]
        try:
            pm = parallelize(lambda: build_model(spec), plan, loss_fn=next_token, device="cpu", seed=0, seq_len=seq)
            opts = [torch.optim.AdamW(p.parameters(), lr=1e-4) for p in pm.model_parts]
            x = torch.randint(vocab, (plan.local_batch(), seq + 1), generator=torch.Generator().manual_seed(1))
            inputs, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()
            counts = None
            for j in range(2):
                mode = Count()
                with mode if j == 1 else contextlib.nullcontext():
                    pm.forward_backward(inputs, labels)
                    for o in opts:
                        o.step()
                        o.zero_grad(set_to_none=True)
                counts = dict(mode.n)
            del pm, opts
        except Exception as e:  # noqa: BLE001 - as in _worker
            state.write(json.dumps({"task": k, "plan": i, "error": f"{type(e).__name__}: {str(e)[:200]}"}) + "\n")
            state.close()
            os._exit(3)
        state.write(json.dumps({"task": k, "plan": i, "rep": rep, "counts": counts}) + "\n")
        gc.collect()
    state.close()
    return {"ok": True}


def _lstsq_nonneg(X: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with non-negative coefficients (drop negative ones and refit; few columns)."""
    import numpy as np

    cols = list(range(len(X[0])))
    A, b = np.asarray(X, dtype=float), np.asarray(y, dtype=float)
    while True:
        coef = np.zeros(A.shape[1])
        if cols:
            sol, *_ = np.linalg.lstsq(A[:, cols], b, rcond=None)
            coef[cols] = sol
        neg = [c for c in cols if coef[c] < 0]
        if not neg:
            return [float(c) for c in coef]
        cols = [c for c in cols if c not in neg]


def explain_gap(section: dict, world: int, log=print) -> dict:
    """Count the ops every measured plan of one sweep section dispatches per step (one more group
    run, not timed), then fit ``measured = a x predicted + b x aten ops + c x c10d ops + d`` across
    the plans (non-negative least squares, relative residuals): the per-op costs the cost model
    has no term for. Reports the fit in-sample and leave-one-out (each plan predicted by a fit on
    the others) as Spearman / MAPE / regret."""
    from dtorch.plan.plan import Plan

    rows = [r for r in section["plans"] if r["measured_step_time_s"] is not None]
    if not all(r.get("plan_doc") for r in rows):
        # an older sweep result: search again on the same calibrated cluster, match by description
        from dtorch.cluster import local_cluster
        from dtorch.model import profile_module
        from dtorch.models import build_model
        from dtorch.plan.search import search

        prof = profile_module(lambda: build_model(section["model"]), SEQ)
        res = search(prof, local_cluster(world), global_batch=GLOBAL_BATCH, seq_len=SEQ, top_k=100_000,
                     dtype="float32", suggest=False)
        docs = {p.describe(): p.to_dict() for p, _ in res.ranked}
        for r in rows:
            r.setdefault("plan_doc", docs.get(r["plan"]))
        rows = [r for r in rows if r.get("plan_doc")]
    plans = [Plan.from_dict(r["plan_doc"]) for r in rows]
    payload = {"model": section["model"], "seq": SEQ, "plans": [p.to_dict() for p in plans], "timeout_s": 120.0}
    log(f"  world {world}: counting dispatched ops of {len(plans)} plans")
    records, failed = _run_tasks(world, payload, [(0, i) for i in range(len(plans))], log=log, worker=_count_worker)
    feats, meas, pred, names = [], [], [], []
    for i, r in enumerate(rows):
        recs = [x for x in records.get(i, []) if x.get("counts")]
        if i in failed or not recs:
            continue
        aten = max(x["counts"].get("aten", 0) for x in recs)
        c10d = max(x["counts"].get("c10d", 0) + x["counts"].get("_c10d_functional", 0) for x in recs)
        m = r["measured_step_time_s"]
        feats.append([r["predicted_step_time_s"], aten, c10d, 1.0])
        meas.append(m)
        pred.append(r["predicted_step_time_s"])
        names.append(r["plan"])
    if len(meas) < 5:
        return {"skipped": "fewer than 5 plans with op counts"}
    # relative residuals: divide each row by the measured time
    Xw = [[f / m for f in row] for row, m in zip(feats, meas)]
    yw = [1.0] * len(meas)
    coef = _lstsq_nonneg(Xw, yw)
    fit = [sum(c * f for c, f in zip(coef, row)) for row in feats]
    loo = []
    for j in range(len(meas)):
        cj = _lstsq_nonneg([x for k, x in enumerate(Xw) if k != j], [1.0] * (len(meas) - 1))
        loo.append(sum(c * f for c, f in zip(cj, feats[j])))
    corr_ops = stats.spearman([f[1] for f in feats], meas)
    return {
        "world_size": world, "plans": len(meas),
        "coefficients": {"predicted_scale": coef[0], "s_per_aten_op": coef[1], "s_per_c10d_op": coef[2],
                         "s_fixed": coef[3]},
        "spearman_aten_ops_vs_measured": corr_ops,
        "spearman_c10d_ops_vs_measured": stats.spearman([f[2] for f in feats], meas),
        "spearman_predicted_vs_measured": stats.spearman(pred, meas),
        "fit_in_sample": {"spearman": stats.spearman(fit, meas), "mape": stats.mape(fit, meas),
                          "regret": stats.regret(fit, meas)},
        "fit_leave_one_out": {"spearman": stats.spearman(loo, meas), "mape": stats.mape(loo, meas),
                              "regret": stats.regret(loo, meas)},
        "per_plan": [{"plan": n, "aten_ops": f[1], "c10d_ops": f[2], "measured_s": m, "predicted_s": f[0],
                      "fit_loo_s": lo} for n, f, m, lo in zip(names, feats, meas, loo)],
        "failed": {names[i] if i < len(names) else str(i): e for i, e in failed.items()},
    }


def run_gap(sweep_result: dict, log=print) -> dict:
    """`explain_gap` for every section of a sweep result."""
    out = []
    for sec in sweep_result.get("results", []):
        out.append({"model": sec["model"], **explain_gap(sec, sec["summary"]["world_size"], log=log)})
    return {"results": out}


def markdown_gap(result: dict) -> str:
    lines = ["## (a') What the sweep's error is made of", "",
             "Per plan, the aten and c10d ops one step dispatches (max over ranks, TorchDispatchMode), then "
             "measured = a x predicted + b x aten ops + c x c10d ops + d, fitted across plans (non-negative, "
             "relative residuals). Leave-one-out predicts each plan from a fit on the others.", "",
             "| world | plans | Spearman(pred) | Spearman(aten ops) | Spearman(c10d ops) | a | us/aten op | ms/c10d op "
             "| d ms | LOO Spearman | LOO MAPE | LOO regret |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        if "skipped" in r:
            continue
        c = r["coefficients"]
        lo = r["fit_leave_one_out"]
        lines.append(f"| {r['world_size']} | {r['plans']} | {r['spearman_predicted_vs_measured']:.3f} | "
                     f"{r['spearman_aten_ops_vs_measured']:.3f} | {r['spearman_c10d_ops_vs_measured']:.3f} | "
                     f"{c['predicted_scale']:.2f} | {c['s_per_aten_op'] * 1e6:.1f} | {c['s_per_c10d_op'] * 1e3:.2f} | "
                     f"{c['s_fixed'] * 1e3:.1f} | {lo['spearman']:.3f} | {lo['mape']:.1%} | {lo['regret']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description="re-predict a stored sweep with the current cost model")
    ap.add_argument("--rescore", required=True, help="a sweep.json written by `python -m benchmarks`")
    ap.add_argument("--calibration", choices=CALIBRATIONS, default="before",
                    help="predict with the probe before each world's sweep (default), the one after it, "
                         "their mean, or the calibration stored now")
    ap.add_argument("--drop", action="append", default=[], metavar="FIELD",
                    help="predict as if the calibration lacked this field, dotted (attention, links.intra.sync_skew); "
                         "repeatable")
    args = ap.parse_args()
    rescore(json.loads(Path(args.rescore).read_text()), calibration=args.calibration, drop=tuple(args.drop))
