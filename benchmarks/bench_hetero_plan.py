"""Planning mixed clusters (issue 14): what the planner chooses on mixed presets, whether it fits every
group's memory, and its predicted throughput against the uniform split and the fastest group alone.

    python -m benchmarks.bench_hetero_plan      # or --only k of `python -m benchmarks`; ~1 min
                                                # writes benchmarks/results/hetero_plan.{json,md}

For each preset (`a100:2x8+h100:2x8`, `mi300x:1x8+h100:1x8`, `h100:4x8+h200:4x8`) and model
(llama3-8b at batch 128, llama3-70b at batch 64; seq 4096), all predictions of the cost model:

- auto: the search as it runs (`dtorch plan`): every rank costed on its own group's speed and
  memory, uneven pipeline stages and uneven data-parallel shares by group speed and memory searched;
- uniform: the best plan in which every rank does the same work (no uneven stages apportioned by
  group, no dp_shares), costed per group like the others (the honest even baseline);
- old planner: what the planner chose before issue 14 (the slowest group's speed, its memory for
  every rank: a search on the cluster with every group's device replaced by the slowest one),
  costed on the real cluster: does it fit, how fast;
- fastest group only: the fastest group alone at the same global batch.

Every chosen plan must fit every group's memory (`all_fit`). Nothing here is measured on hardware:
these are the planner's own predictions (the executor half measures a slowed worker on this
machine, `benchmarks/bench_hetero_run.py` when it lands).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PRESETS = ("a100:2x8+h100:2x8", "mi300x:1x8+h100:1x8", "h100:4x8+h200:4x8")
MODELS = (("llama3-8b", 128, 4096), ("llama3-70b", 64, 4096))
EXTRA = (("a100:1x8+h100:1x8", "gpt2-small", 64, 1024, None),
         ("a100:1x8+h100:1x8", "gpt2-small", 64, 1024, "pp=1,tp=1,dp_shard=1"))
"""A model small enough for plain data parallelism: free, the search pipelines it (the head on the
H100 stage balances it); with data parallelism fixed, uneven dp_shares are what helps."""


@contextlib.contextmanager
def _uniform_only():
    """The search without apportioning work by group: no stage partitions by group, no dp_shares."""
    from dtorch.plan import hetero
    from dtorch.plan.strategies.batch import Batch

    saved = hetero.stage_partitions, Batch.variants
    hetero.stage_partitions = lambda *a, **k: []
    Batch.variants = lambda self, plan, fixed, cluster: []
    try:
        yield
    finally:
        hetero.stage_partitions, Batch.variants = saved


def _row(plan, est) -> dict:
    return {
        "plan": plan.describe(), "family": plan.family(), "fits": est.fits,
        "step_s": est.step_time_s, "tokens_per_s": est.tokens_per_s,
        "groups": [{k: g[k] for k in ("group", "device", "ranks", "microbatches", "blocks", "fits")}
                   | {"memory_gib": g["memory_bytes"] / 2**30, "capacity_gib": g["memory_capacity"] / 2**30}
                   for g in est.groups],
    }


def _best(profile, cluster, gb, fix=None):
    from dtorch.plan.search import parse_fix, search

    res = search(profile, cluster, global_batch=gb, top_k=1, suggest=False, fixed=parse_fix(fix))
    return res.best


def case(preset: str, model: str, gb: int, seq: int, fix: str | None = None) -> dict:
    from dtorch.cluster.load import load_cluster
    from dtorch.cluster.spec import Cluster
    from dtorch.plan import hetero
    from dtorch.plan.cost import estimate
    from dtorch.plan.profiles import get_profile

    prof, cl = get_profile(model, seq), load_cluster(preset)
    t0 = time.perf_counter()
    auto = _best(prof, cl, gb, fix)
    wall = time.perf_counter() - t0
    with _uniform_only():
        uniform = _best(prof, cl, gb, fix)
    slow = cl.slowest_group()
    old_cl = Cluster([dataclasses.replace(g, device=slow.device) for g in cl.groups], name="as-slowest")
    old = _best(prof, old_cl, gb, fix)
    fast = max(cl.groups, key=hetero.group_speed)
    fast_only = _best(prof, Cluster([fast], name="fastest"), gb, fix)
    out = {"preset": preset, "model": model, "global_batch": gb, "seq_len": seq, "fixed": fix, "search_wall_s": wall,
           "auto": _row(*auto), "uniform": _row(*uniform) if uniform else None,
           "fastest_group": f"{fast.num_devices} x {fast.device.name}",
           "fastest_only": _row(*fast_only) if fast_only else None}
    if old is not None:
        out["old_planner"] = _row(old[0], estimate(old[0], prof, cl)) | {"old_claimed_gib": old[1].memory_bytes_per_rank / 2**30}
    best = out["auto"]["tokens_per_s"]
    out["all_fit"] = all(g["fits"] for g in out["auto"]["groups"]) and out["auto"]["fits"]
    out["auto_over_uniform"] = out["auto"]["tokens_per_s"] / out["uniform"]["tokens_per_s"] if uniform else None
    out["best_over_uniform"] = best / out["uniform"]["tokens_per_s"] if uniform else None
    out["best_over_fastest_only"] = best / out["fastest_only"]["tokens_per_s"] if fast_only else None
    return out


def run(log=None, out_dir: Path = RESULTS) -> dict:
    """Every case planned; written to `out_dir`/hetero_plan.json and .md, and returned."""
    rows = []
    for preset, model, gb, seq, fix in [(p, *m, None) for p in PRESETS for m in MODELS] + list(EXTRA):
        rows.append(case(preset, model, gb, seq, fix))
        if log:
            log(f"hetero_plan {preset} {model}: {rows[-1]['auto']['plan']}")
    doc = {"cases": rows, "all_fit": all(r["all_fit"] for r in rows),
           "note": "cost-model predictions (no hardware)"}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "hetero_plan.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out_dir / "hetero_plan.md").write_text(markdown(doc))
    return doc


def _tps(row: dict | None) -> str:
    if row is None:
        return "none fits"
    return f"{row['tokens_per_s']:,.0f}" + ("" if row["fits"] else " (does not fit)")


def markdown(doc: dict) -> str:
    lines = ["# Planning mixed clusters (issue 14)", "",
             "`python -m benchmarks.bench_hetero_plan`. Predicted by the cost model (no hardware). Tokens/s of",
             "the whole cluster; *auto* is what `dtorch plan` chooses (uneven stages and data-parallel shares",
             "searched), *uniform* the best plan giving every rank the same work,",
             "*old* what the planner chose before (slowest group's speed and memory for every rank) costed on",
             "the real cluster, *fastest only* the fastest group alone at the same batch.", "",
             f"Every chosen plan fits every group's memory: **{doc['all_fit']}**.", "",
             "The ranking keeps a 3 % margin for float32 gradient reduction and 1 % for uneven stages, so a",
             "plan a few per cent faster in raw step time (e.g. the old planner's bf16-reduced one) can rank",
             "below the chosen one.", "",
             "| cluster | model (batch x seq) | auto | uniform | old planner | fastest only | best/uniform "
             "| best/fastest |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in doc["cases"]:
        old = r.get("old_planner")
        old_s = "none" if old is None else (_tps(old) if old["fits"] else
                                            f"needs {max(g['memory_gib'] for g in old['groups']):.0f} GiB/rank: does not fit")
        lines.append(f"| {r['preset']} | {r['model']} ({r['global_batch']} x {r['seq_len']}{', ' + r['fixed'] if r['fixed'] else ''}) | {_tps(r['auto'])} | "
                     f"{_tps(r['uniform'])} | {old_s} | {_tps(r['fastest_only'])} ({r['fastest_group']}) | "
                     f"{r['best_over_uniform'] or 0:.2f}x | {r['best_over_fastest_only'] or 0:.2f}x |")
    lines += ["", "## Chosen plans and how work was apportioned", ""]
    for r in doc["cases"]:
        lines.append(f"- **{r['preset']}, {r['model']}** (search {r['search_wall_s']:.1f} s): auto `{r['auto']['plan']}`; "
                     f"uniform `{r['uniform']['plan'] if r['uniform'] else '-'}`")
        for g in r["auto"]["groups"]:
            lines.append(f"  - group {g['group']} {g['device']} ranks {g['ranks']}: blocks {g['blocks']}, "
                         f"micro-batches {g['microbatches']}, {g['memory_gib']:.1f} of {g['capacity_gib']:.1f} GiB")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    d = run(log=print)
    print(markdown(d))
