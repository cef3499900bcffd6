"""One command for every DTorch benchmark:

    python -m benchmarks                      # everything (probe first: the sweep uses its calibration)
    python -m benchmarks --quick              # fewer plans, repetitions and sizes
    python -m benchmarks --only probe,sweep   # or by letter: --only a,b (a sweep, b overhead, c mfu,
                                              # d planner, e checkpoint, f recovery, g mainjob, h compile,
                                              # i offload, j failure_cost, k hetero_plan, l hetero, m anymodel)

Writes benchmarks/results/latest.json and latest.md, and each section's own <name>.json / <name>.md
(with --out DIR: all of them under DIR, nothing in the checkout's results). Calibrations go to
<out>/calibration/ (not the user's cache) unless $DTORCH_CALIBRATION_DIR is set. A section that fails is recorded with its traceback; the others run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import json
import os
import platform
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ORDER = ("probe", "sweep", "gap", "overhead", "mfu", "planner", "checkpoint", "recovery", "failure_cost", "mainjob",
         "compile", "offload", "hetero_plan", "hetero", "anymodel")
LETTERS = {"a": "sweep", "b": "overhead", "c": "mfu", "d": "planner", "e": "checkpoint", "f": "recovery",
           "g": "mainjob", "h": "compile", "i": "offload", "j": "failure_cost", "k": "hetero_plan", "l": "hetero",
           "m": "anymodel"}
OWN_FILES = ("planner", "checkpoint", "hetero_plan")
"""Sections whose modules write their own <name>.json/.md (kept as they are, never overwritten)."""
TARGETS = {"spearman": 0.8, "regret": 1.10, "overhead": 1.03, "probe_s": 60.0, "recovery_s": 1.5,
           "steps_redone": 1, "stall_pct": 2.0}


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now().strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _out() -> Path:
    """The results folder of this run (--out; `main` publishes it as DTORCH_BENCH_OUT)."""
    return Path(os.environ.get("DTORCH_BENCH_OUT", RESULTS))


def _call_run(module, **wanted) -> Any:
    """module.run(**the wanted kwargs it accepts); a section that writes its own files is given
    the results folder as `out_dir`."""
    wanted.setdefault("out_dir", _out())
    params = inspect.signature(module.run).parameters
    return module.run(**{k: v for k, v in wanted.items() if k in params})


# ---- sections ---------------------------------------------------------------------------------------
def section_probe(quick: bool) -> dict:
    from dtorch.cluster.probe import run_probe, summary

    out = {}
    for n in (1, 2, 4):
        t = time.perf_counter()
        doc, path = run_probe(n, quick=quick)
        wall = time.perf_counter() - t
        log(summary(doc))
        out[doc["cluster"]] = {"wall_s": wall, "path": str(path), "summary": summary(doc),
                               "device": doc["device"], "links": doc.get("links", {}),
                               "probe_seconds": doc.get("probe_seconds")}
    return {"results": out}


def md_probe(r: dict) -> str:
    lines = ["## Probe (calibration used by the sweep)", ""]
    for name, d in r["results"].items():
        lines += [f"**{name}** - wall {d['wall_s']:.1f} s (spawn + measure)", "", "```", d["summary"], "```", ""]
    return "\n".join(lines)


def section_sweep(quick: bool) -> dict:
    from benchmarks import bench_sweep

    return bench_sweep.run(quick=quick, probe=True, log=log)


def section_gap(quick: bool) -> dict:
    """Op counts of the sweep's plans and the per-op fit (reads the sweep's last result)."""
    from benchmarks import bench_sweep

    f = _out() / "sweep.json"
    if not f.is_file():
        return {"skipped": "run the sweep first"}
    return bench_sweep.run_gap(json.loads(f.read_text()), log=log)


def section_overhead(quick: bool) -> dict:
    from benchmarks import bench_overhead

    return bench_overhead.run(quick=quick, log=log)


def section_mfu(quick: bool) -> dict:
    from benchmarks import bench_mfu

    return bench_mfu.run(quick=quick, log=log)


def _optional(name: str):
    try:
        return importlib.import_module(f"benchmarks.bench_{name}")
    except ModuleNotFoundError as e:
        if e.name == f"benchmarks.bench_{name}":
            return None
        raise


def section_planner(quick: bool) -> dict:
    mod = _optional("planner")
    if mod is None:
        return {"skipped": "benchmarks/bench_planner.py is not there yet"}
    return _call_run(mod, **({"sizes": [64, 1024, 16384], "repeats": 1} if quick else {}))


def section_checkpoint(quick: bool) -> dict:
    mod = _optional("checkpoint")
    if mod is None:
        return {"skipped": "benchmarks/bench_checkpoint.py is not there yet"}
    return _call_run(mod, **({"repeats": 1} if quick else {}))


def section_recovery(quick: bool) -> dict:
    mod = _optional("recovery")
    if mod is None:
        return {"skipped": "benchmarks/bench_recovery.py is not there yet (the elastic engineer's drill hooks in "
                           "here: a module with run() -> dict)"}
    return _call_run(mod, quick=quick)


def section_failure_cost(quick: bool) -> dict:
    """Kill one of 2 workers every 30 steps (issue 11): recovery time, steps redone, ETTR, stall."""
    from benchmarks import bench_failure_cost

    return bench_failure_cost.run(quick=quick, log=log)


def section_mainjob(quick: bool) -> dict:
    from benchmarks import bench_mainjob

    return bench_mainjob.run(quick=quick, log=log)


def section_compile(quick: bool) -> dict:
    from benchmarks import bench_compile

    return bench_compile.run(quick=quick, log=log)


def section_offload(quick: bool) -> dict:
    """Optimizer memory tiers: peak RSS and step time in memory / host / NVMe (bench_offload)."""
    from benchmarks import bench_offload

    return bench_offload.run(quick=quick, log=log)


def section_hetero_plan(quick: bool) -> dict:
    """Mixed presets planned (issue 14): fits per group, throughput against uniform and fastest-only."""
    from benchmarks import bench_hetero_plan

    return bench_hetero_plan.run(log=log, out_dir=_out())


def section_hetero(quick: bool) -> dict:
    """Uneven work: one of 2 workers slowed to half speed; uniform vs uneven shares vs ideal (bench_hetero)."""
    from benchmarks import bench_hetero

    return bench_hetero.run(quick=quick, log=log)


def section_anymodel(quick: bool) -> dict:
    """Models DTorch did not write on every plan offered them, against a plain loop (bench_anymodel)."""
    from benchmarks import bench_anymodel

    return bench_anymodel.run(steps=3 if quick else 5, speed=not quick, log=log)


SECTIONS = {name: globals()[f"section_{name}"] for name in ORDER}


def _markdown(name: str, result: dict) -> str:
    if "error" in result:
        return f"## {name}\n\nFAILED:\n\n```\n{result['error'][-3000:]}\n```\n"
    if "skipped" in result:
        return f"## {name}\n\nskipped: {result['skipped']}\n"
    if name == "probe":
        return md_probe(result)
    if name == "hetero":
        from benchmarks import bench_hetero

        return bench_hetero.markdown(result)
    if name == "mainjob":
        from benchmarks import bench_mainjob

        return bench_mainjob.markdown(result)
    if name == "offload":
        from benchmarks import bench_offload

        return bench_offload.markdown(result)
    if name == "gap":
        from benchmarks import bench_sweep

        return bench_sweep.markdown_gap(result)
    mod = _optional(name) if name in ("planner", "checkpoint", "recovery", "failure_cost") else \
        importlib.import_module({"sweep": "benchmarks.bench_sweep", "overhead": "benchmarks.bench_overhead",
                                 "mfu": "benchmarks.bench_mfu", "compile": "benchmarks.bench_compile",
                                 "hetero_plan": "benchmarks.bench_hetero_plan",
                                 "anymodel": "benchmarks.bench_anymodel"}[name])
    if mod is not None and hasattr(mod, "markdown"):
        try:
            return mod.markdown(result)
        except Exception:  # noqa: BLE001 - a section's own formatter must not lose its numbers
            pass
    own = _out() / f"{name}.md"  # a section module that writes its own report
    if name in OWN_FILES and own.is_file():
        letter = next(k for k, v in LETTERS.items() if v == name)
        return f"## ({letter}) {name}\n\n" + own.read_text()
    return f"## {name}\n\n```json\n{json.dumps(result, indent=1, default=str)[:6000]}\n```\n"


def _targets(sections: dict) -> list[str]:
    """The issue's targets against this run's figures: one markdown table."""
    rows = []
    sweep = sections.get("sweep", {})
    for r in sweep.get("results", []):
        s = r["summary"]
        tag = f"world {s['world_size']} ({r['model'].split(':')[0]})"
        if s.get("spearman") is not None:
            rows.append((f"Spearman, {tag}", f"{s['spearman']:.3f}", ">= 0.8" if s["world_size"] == 4 else "(info)",
                         s["spearman"] >= TARGETS["spearman"] if s["world_size"] == 4 else None))
        if s.get("regret") is not None:
            rows.append((f"regret, {tag}", f"{s['regret']:.3f}", "<= 1.10" if s["world_size"] == 4 else "(info)",
                         s["regret"] <= TARGETS["regret"] if s["world_size"] == 4 else None))
        if s.get("mape") is not None:
            rows.append((f"step-time MAPE, {tag}", f"{s['mape']:.1%}", "(info)", None))
    for r in sections.get("gap", {}).get("results", []):
        if "fit_leave_one_out" in r:
            lo = r["fit_leave_one_out"]
            rows.append((f"per-op fit, leave-one-out Spearman / MAPE, world {r['world_size']}",
                         f"{lo['spearman']:.3f} / {lo['mape']:.1%}", "(what would close it)", None))
    for r in sections.get("overhead", {}).get("results", []):
        if r.get("ratio") is not None:
            rows.append((f"overhead {r['strategy']}", f"{r['ratio']:.3f}", "<= 1.03", r["ratio"] <= TARGETS["overhead"]))
    for name, d in sections.get("probe", {}).get("results", {}).items():
        rows.append((f"probe wall time, {name}", f"{d['wall_s']:.1f} s", "< 60 s", d["wall_s"] < TARGETS["probe_s"]))
    fc = sections.get("failure_cost", {}).get("snapshots every step")
    if fc and fc.get("recovery_median_s") is not None:
        rows.append(("recovery after a worker kill, median", f"{fc['recovery_median_s']:.2f} s", "<= 1.5 s",
                     fc["recovery_median_s"] <= TARGETS["recovery_s"]))
        rows.append(("steps redone per failure, max", str(fc["max_steps_redone"]), "<= 1",
                     fc["max_steps_redone"] is not None and fc["max_steps_redone"] <= TARGETS["steps_redone"]))
        if fc.get("snapshot_stall_pct_of_step") is not None:
            rows.append(("snapshot stall, % of step", f"{fc['snapshot_stall_pct_of_step']:.2f} %", "<= 2 %",
                         fc["snapshot_stall_pct_of_step"] <= TARGETS["stall_pct"]))
        rows.append(("ETTR with kills every 30 steps", f"{fc['ettr']:.3f}", "(info)", None))
    mfu = sections.get("mfu", {})
    if mfu.get("achieved_flops") and mfu["peaks"].get("detected"):
        # against the CPU's detected peak, the denominator DTorch reports MFU against (dtorch.cluster.peak)
        rows.append(("single-process MFU (detected CPU peak)", f"{mfu['achieved_flops'] / mfu['peaks']['detected']:.1%}",
                     "(info)", None))
    off = sections.get("offload", {}).get("summary")
    if off:
        rows.append(("peak RSS drop with the NVMe optimizer tier", f"{off['rss_drop_bytes'] / 2**30:.2f} GiB",
                     f">= {off['rss_drop_target_bytes'] / 2**30:.2f} GiB (state - buffers)", off["rss_drop_met"]))
        for t, x in (off.get("tiers") or {}).items():
            if x.get("ratio") is not None:
                rows.append((f"{t} optimizer phase, measured / planner", f"{x['ratio']:.2f} "
                             f"({x['measured_optimizer_s']:.2f} / {x['predicted_optimizer_s']:.2f} s)",
                             "0.75-1.25", x["within_25pct"]))
    lines = ["| figure | value | target | met |", "|---|---|---|---|"]
    for fig, val, tgt, ok in rows:
        lines.append(f"| {fig} | {val} | {tgt} | {'' if ok is None else ('yes' if ok else '**no**')} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help="comma list of sections: " + ", ".join(ORDER) + " (or their letters: " + ", ".join(f"{k} {v}" for k, v in LETTERS.items()) + ")")
    p.add_argument("--quick", action="store_true", help="fewer plans, repetitions and sizes")
    p.add_argument("--out", default=str(RESULTS), help="results folder")
    args = p.parse_args(argv)
    names = list(ORDER)
    if args.only:
        names = []
        for x in args.only.split(","):
            x = LETTERS.get(x.strip(), x.strip())
            if x not in SECTIONS:
                p.error(f"--only: unknown section {x!r}; use {', '.join(ORDER)} or their letters")
            names.append(x)
        names = [n for n in ORDER if n in names]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DTORCH_CALIBRATION_DIR", str(out / "calibration"))
    os.environ["DTORCH_BENCH_OUT"] = str(out)
    os.environ.pop("DTORCH_NO_CALIBRATION", None)

    latest_json = out / "latest.json"
    previous = json.loads(latest_json.read_text()) if latest_json.is_file() else {}
    sections: dict[str, Any] = dict(previous.get("sections", {}))  # --only keeps the other sections' last results
    ran = {}
    t_all = time.perf_counter()
    load_before = os.getloadavg()[0]
    for name in names:
        log(f"== {name}")
        t = time.perf_counter()
        try:
            result = SECTIONS[name](args.quick)
        except Exception:  # noqa: BLE001 - one failed section must not lose the others
            result = {"error": traceback.format_exc()}
            log(result["error"])
        result = {**result, "wall_s": time.perf_counter() - t, "quick": args.quick,
                  "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        sections[name] = ran[name] = result
        if name not in OWN_FILES:
            (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
            (out / f"{name}.md").write_text(_markdown(name, result))
        log(f"== {name} done in {result['wall_s']:.0f} s")

    import torch

    doc = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": socket.gethostname(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
           "torch": torch.__version__, "cuda": torch.cuda.is_available(),
           "load_average": os.getloadavg(), "load_average_before": load_before, "ran": list(ran),
           "sections": sections}
    latest_json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md = ["# DTorch benchmarks (latest)", "",
          f"{doc['created']} on {doc['host']} ({doc['cpu_count']} CPUs, torch {doc['torch']}, "
          f"load average {load_before:.1f} before, {doc['load_average'][0]:.1f} at the end, the benchmark's own "
          "worker processes included; timings on a shared machine are noisy). "
          f"This run: {', '.join(ran) or 'nothing'} in {time.perf_counter() - t_all:.0f} s; "
          "other sections are from their last run (see each section's `created`).", "",
          "## Targets", "", *_targets(sections), ""]
    for name in ORDER:
        if name in sections:
            md += [_markdown(name, sections[name]), f"_section run {sections[name].get('created', '?')}, "
                   f"{sections[name].get('wall_s', 0):.0f} s{', quick' if sections[name].get('quick') else ''}_", ""]
    (out / "latest.md").write_text("\n".join(md) + "\n")
    log(f"wrote {latest_json} and {out / 'latest.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
