"""The any-model matrix: models DTorch did not write, on every plan the planner offers, against a
plain single-process PyTorch loop.

    python -m benchmarks.bench_anymodel                  # every case of benchmarks/zoo.py
    python -m benchmarks.bench_anymodel --only cnn,vit   # some cases
    python -m benchmarks.bench_anymodel --speed          # also: transformers Llama vs DTorch's Llama

For each case (`benchmarks/zoo.py`: hand-written models with their own names, transformers classes
from tiny configs) the planner is asked, as `dtorch.Trainer` asks it, for the plans it offers at
world 2 in float32: the auto plan and the fastest plan of every strategy family, and the strategies it
does not offer with their reasons. Each offered plan then trains `--steps` AdamW steps through
`dtorch.Trainer` in ONE group of two gloo processes, and its per-step losses are compared with
`zoo.plain_loop` (target: within 1e-5 relative). `--speed` times the auto plan of a transformers
Llama factory against DTorch's own Llama of the same shape, side by side in one group (target:
within 1.10x).

Writes benchmarks/results/anymodel.json and anymodel.md (or under --out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import zoo

RESULTS = Path(__file__).resolve().parent / "results"
WORLD = 2
GLOBAL_BATCH = 8
REL = 1e-5


def _trainer(case: zoo.Case, plan: Any, **kw: Any):
    from dtorch.train.optim import AdamW, Constant
    from dtorch.train.trainer import Trainer

    return Trainer(model=case.factory, data=case.dataset(), loss=case.loss, global_batch=GLOBAL_BATCH,
                   seq_len=zoo.SEQ, plan=plan, lr_schedule=Constant(), max_grad_norm=None, console=False,
                   optimizer=AdamW(lr=zoo.LR, betas=(0.9, 0.999), weight_decay=0.01),  # torch's AdamW defaults
                   straggler_every=0, metrics_every=0, **kw)


def offers(case: zoo.Case, world: int = WORLD) -> dict[str, Any]:
    """What the planner offers for `case` at `world` ranks in float32, asked as the Trainer asks:
    {"auto": plan, "families": {family: plan}, "not_offered": {strategy: why},
    "rejected": {family: why}} (plans as dicts)."""
    from dtorch.plan.strategies import refusals

    trainer = _trainer(case, {"param_dtype": "float32", "reduce_dtype": "float32"})
    result = trainer.search_result(world)
    return {
        "auto": result.best[0].to_dict() if result.best else None,
        "families": {fam: p.to_dict() for fam, (p, _) in result.best_by_family.items()},
        "not_offered": refusals(result.profile),
        "rejected": dict(result.rejected),
    }


def _worker(job: dict, rank: int) -> dict:
    from dtorch.plan.plan import Plan

    case = {c.name: c for c in zoo.cases()}[job["case"]]
    plan = Plan.from_dict(job["plan"]) if job["plan"] is not None else "auto"
    t0 = time.perf_counter()
    got = _trainer(case, plan).fit(job["steps"])
    return {"losses": [got.losses[s] for s in sorted(got.losses)], "plan": got.plan.describe(),
            "microbatch": got.plan.microbatch_size,
            "family": got.plan.family(), "wall_s": time.perf_counter() - t0}


def _machine() -> str:
    """The CPU model and core count (the figures are of this machine)."""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        model = "?"
    return f"{model}, {os.cpu_count()} cores"


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def run(only: list[str] | None = None, steps: int = 5, speed: bool = False, log=print) -> dict:
    from tests.parallel._harness import run_group

    cases = [c for c in zoo.cases() if not only or c.name in only]
    cases_by_name = {c.name: c for c in cases}
    report: dict[str, Any] = {"world": WORLD, "global_batch": GLOBAL_BATCH, "steps": steps, "target_rel": REL,
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": _machine(),
                              "torch": torch.__version__, "cases": {}}
    jobs = []
    for case in cases:
        entry: dict[str, Any] = {"tags": sorted(case.tags)}
        try:
            entry.update(offers(case))
        except Exception as e:  # noqa: BLE001 - a case the planner cannot take is a result, not a crash
            entry["error"] = f"{type(e).__name__}: {e}"
            log(f"{case.name}: planner: {entry['error']}")
            report["cases"][case.name] = entry
            continue
        entry["reference"] = zoo.plain_loop(case, steps, GLOBAL_BATCH)
        entry["runs"] = {}
        report["cases"][case.name] = entry
        plans = {"auto": entry["auto"], **entry["families"]}
        jobs += [{"case": case.name, "label": label, "plan": plan, "steps": steps} for label, plan in plans.items()]
    log(f"{len(jobs)} runs in one group of {WORLD}")
    t0 = time.perf_counter()
    results = run_group(WORLD, jobs, _worker) if jobs else []
    for job, per_rank in zip(jobs, results):
        entry = report["cases"][job["case"]]
        errors = [r["error"] for r in per_rank if "error" in r]
        if errors:
            entry["runs"][job["label"]] = {"error": errors[0].strip().splitlines()[-1]}
            continue
        losses = per_rank[0]["losses"]
        reference = entry["reference"]
        case = cases_by_name[job["case"]]
        if case.batch_dependent:  # compared on the micro-batches this plan ran
            reference = zoo.plain_loop(case, steps, GLOBAL_BATCH, microbatch=per_rank[0]["microbatch"])
        entry["runs"][job["label"]] = {
            "plan": per_rank[0]["plan"], "losses": losses, "rel": _rel(losses, reference),
            "ranks_agree": all(r["losses"] == losses for r in per_rank), "wall_s": per_rank[0]["wall_s"]}
    report["wall_s"] = time.perf_counter() - t0
    runs = [r for e in report["cases"].values() for r in e.get("runs", {}).values()]
    report["summary"] = {
        "cases": len(cases), "runs": len(runs),
        "within_target": sum(1 for r in runs if "rel" in r and r["rel"] <= REL and r["ranks_agree"]),
        "failed": sum(1 for r in runs if "error" in r),
        "planner_errors": sum(1 for e in report["cases"].values() if "error" in e),
    }
    if speed:
        report["speed"] = speed_check(steps=12, log=log)
    return report


# ---- speed: a transformers Llama factory vs DTorch's own Llama of the same shape -------------------------
SPEED_SHAPE = dict(vocab=4096, dim=256, layers=4, heads=8, kv_heads=4, ffn=688, seq=256)


def _speed_factory(which: str):
    s = SPEED_SHAPE
    if which == "dtorch":
        from dtorch.models import build_model

        return build_model(f"llama:layers={s['layers']},hidden={s['dim']},heads={s['heads']},"
                           f"kv_heads={s['kv_heads']},ffn={s['ffn']},vocab={s['vocab']}")
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=s["vocab"], hidden_size=s["dim"], intermediate_size=s["ffn"],
                                   num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                                   num_key_value_heads=s["kv_heads"], max_position_embeddings=s["seq"],
                                   tie_word_embeddings=False, rms_norm_eps=1e-5)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _speed_worker(job: dict, rank: int) -> dict:
    from functools import partial

    from dtorch.train.optim import AdamW, Constant
    from dtorch.train.trainer import Trainer

    windows = torch.randint(0, SPEED_SHAPE["vocab"], (256, SPEED_SHAPE["seq"] + 1),
                            generator=torch.Generator().manual_seed(0))
    trainer = Trainer(model=partial(_speed_factory, job["which"]), data=list(windows), global_batch=8,
                      seq_len=SPEED_SHAPE["seq"], plan={"param_dtype": "float32", "reduce_dtype": "float32"},
                      lr_schedule=Constant(), optimizer=AdamW(lr=1e-4), console=False, straggler_every=0,
                      metrics_every=0)
    got = trainer.fit(job["steps"])
    steady = sorted(got.step_times[2:])  # the first steps warm caches and allocators
    return {"plan": got.plan.describe(), "step_s": steady[len(steady) // 2]}


def speed_check(steps: int = 12, repeats: int = 3, log=print) -> dict:
    """Median over `repeats` interleaved pairs of runs of the ratio of median steady step times,
    transformers / DTorch (the slower rank of each run)."""
    from tests.parallel._harness import run_group

    jobs = [{"which": w, "steps": steps} for _ in range(repeats) for w in ("hf", "dtorch")]
    results = run_group(WORLD, jobs, _speed_worker)
    step_s: dict[str, list[float]] = {"hf": [], "dtorch": []}
    plans = {}
    for job, per_rank in zip(jobs, results):
        if "error" in per_rank[0]:
            return {"error": per_rank[0]["error"].strip().splitlines()[-1]}
        step_s[job["which"]].append(max(r["step_s"] for r in per_rank))
        plans[job["which"]] = per_rank[0]["plan"]
    ratios = sorted(h / d for h, d in zip(step_s["hf"], step_s["dtorch"]))
    out = {"shape": SPEED_SHAPE, "steps": steps, "plans": plans, "step_s": step_s,
           "ratio_median": ratios[len(ratios) // 2], "ratios": ratios, "target": 1.10}
    log(f"speed: transformers/DTorch Llama median step {out['ratio_median']:.3f}x (plans {plans})")
    return out


# ---- report ---------------------------------------------------------------------------------------------
def markdown(report: dict) -> str:
    s = report["summary"]
    lines = ["# Any-model matrix", "",
             f"World {report['world']}, float32, global batch {report['global_batch']}, {report['steps']} AdamW "
             f"steps; each run's per-step losses against a plain single-process loop (target: within "
             f"{report['target_rel']:g} relative, every rank the same). `python -m benchmarks.bench_anymodel"
             f"{' --speed' if 'speed' in report else ''}`, {report.get('date', '?')}, {report.get('machine', '?')}, "
             f"torch {report.get('torch', '?')}.", "",
             f"**{s['within_target']} of {s['runs']} runs within target** over {s['cases']} models; "
             f"{s['failed']} runs failed; {s['planner_errors']} models the planner could not take.", "",
             "| model | plan | max rel. loss diff | |", "|---|---|---|---|"]
    for name, e in report["cases"].items():
        if "error" in e:
            lines.append(f"| {name} | planner | - | {e['error'][:160]} |")
            continue
        for label, r in e["runs"].items():
            if "error" in r:
                lines.append(f"| {name} | {label} | - | FAILED: {r['error'][:160]} |")
            else:
                ok = "ok" if r["rel"] <= report["target_rel"] and r["ranks_agree"] else "**off**"
                lines.append(f"| {name} | {label}: `{r['plan']}` | {r['rel']:.1e} | {ok} |")
    lines += ["", "## Not offered, and why", ""]
    for name, e in report["cases"].items():
        reasons = {**e.get("not_offered", {})}
        if reasons:
            lines.append(f"- **{name}**: " + "; ".join(f"{k}: {v}" for k, v in reasons.items()))
    if "speed" in report:
        sp = report["speed"]
        lines += ["", "## Speed: transformers Llama factory vs DTorch's Llama (auto plan, world 2)", ""]
        if "error" in sp:
            lines.append(f"failed: {sp['error']}")
        else:
            lines.append(f"Shape {sp['shape']}, {sp['steps']} steps, plans {sp['plans']}: median steady step-time ratio "
                         f"transformers / DTorch median **{sp['ratio_median']:.3f}x** (runs "
                         f"{', '.join(f'{r:.3f}' for r in sp['ratios'])}; target <= {sp['target']}x).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated case names (default: all)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--speed", action="store_true", help="also time a transformers Llama against DTorch's")
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory for anymodel.json / anymodel.md")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report = run(args.only.split(",") if args.only else None, steps=args.steps, speed=args.speed,
                 log=lambda m: print(m, file=sys.stderr, flush=True))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "anymodel.json").write_text(json.dumps(report, indent=1))
    (args.out / "anymodel.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
