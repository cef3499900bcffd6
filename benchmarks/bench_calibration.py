"""The cost model against published runs, leave-one-source-out (benchmarks/published/*.yaml).

    python -m benchmarks.bench_calibration     # writes benchmarks/results/published_loso.{json,md}
    python -m benchmarks.bench_calibration --quick --out DIR   # procedure (2) on 2 grid points, under DIR

Two procedures, side by side: (1) per held-out source, refit the per-device matmul efficiencies on
the other sources, global constants as shipped; (2) refit the two global constants too. Sources
kept for testing first (`benchmarks/published/testing/*.yaml`) are never fitted: each is predicted
before any fitting (`calibration.prior`) and with procedures (1) and (2) fitted on every source,
which is its leave-one-source-out; and, in a separate table, what every source's leave-one-out would
be if they joined the fit; (3) every bfloat16 row as `dtorch plan --fix` prices it (DTorch's executor,
not the source's framework). Also the sizing example (`dtorch plan --model llama3-405b --recommend
...`) with its wall time. Pure CPU.

`run() -> dict` is the entry point for a benchmark runner.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dtorch.plan import calibration as C

RESULTS = Path(__file__).resolve().parent / "results"
TESTING = C.PUBLISHED_DIR / "testing"
"""Published sources kept for testing first: reported, never fitted (move a file up to join the fit)."""
RECOMMEND = ["plan", "--model", "llama3-405b", "--recommend", "--device-type", "h100", "--tokens", "15T",
             "--deadline", "60d", "--json"]


def _held(res: list[C.HeldOut]) -> list[dict]:
    return [{"source": h.source, "rows": len(h.rows), "mean_abs_error": h.mean_abs, "mean_signed_error": h.mean_signed,
             "max_abs_error": h.max_abs, "borrowed": dict(h.fit.borrowed), "efficiencies": dict(h.fit.efficiencies),
             "per_row": [{"row": r.name, "published": r.tokens_per_s_per_gpu, "predicted": p, "error": e}
                         for r, p, e in h.rows]} for h in res]


def testing(grid=(), folder: Path = TESTING) -> list[C.HeldOut]:
    """Every source of `folder`, predicted before any fitting (`C.prior`) and with the device
    efficiencies (and, with `grid`, the global constants) fitted on every source of
    `C.PUBLISHED_DIR`, which never saw it. A device no fitted source measured borrows its
    generation's efficiency, as in `C.loso`."""
    if not folder.is_dir():
        return []
    _, rows, specs = C._load(str(folder))
    models = {n: C._profile(n, spec) for n, spec in specs}
    full = C.fit(grid=grid)
    out = []
    for src in sorted({r.source for r in rows}):
        held = [r for r in rows if r.source == src]
        devices = {C.device_of(r) for r in held}
        f = C.Fit(full.constants, dict(full.efficiencies), full.loss)
        effs = dict(f.efficiencies)
        for dev in sorted(devices - set(effs)):
            got = C._borrow(full, dev)
            if got is None:
                f.borrowed[dev] = "preset"
                continue
            effs[dev], gen = got
            f.borrowed[dev] = f"{gen} fit"
        after, before = ([(r, p, p / r.tokens_per_s_per_gpu - 1.0) for r in held for p in [C.predict(r, c, models)[0]]]
                         for c in (C._with(f.constants, effs), C.prior(devices)))
        out.append(C.HeldOut(src, after, f, before))
    return out


_ADMITTED = """
import json
from dtorch.plan import calibration as C
res = C.loso()
print(json.dumps({"table": C.loso_table(res), "held": [
    {"source": h.source, "rows": len(h.rows), "before_fitting": h.before_mean_abs, "mean_abs_error": h.mean_abs,
     "mean_signed_error": h.mean_signed, "max_abs_error": h.max_abs} for h in res]}))
"""


def _admitted(folder: Path = TESTING) -> dict:
    """Procedure (1) over the fitted sources and `folder`'s together, as if the testing sources had
    joined the fit (a fresh interpreter reading a merged copy through $DTORCH_PUBLISHED_DIR)."""
    with tempfile.TemporaryDirectory() as tmp:
        for path in [*sorted(C.PUBLISHED_DIR.glob("*.yaml")), *sorted(folder.glob("*.yaml"))]:
            shutil.copy(path, Path(tmp) / path.name)
        out = subprocess.run([sys.executable, "-c", _ADMITTED], capture_output=True, text=True, check=True,
                             env={**os.environ, "DTORCH_PUBLISHED_DIR": tmp})
    return json.loads(out.stdout)


def _recommend() -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "dtorch.cli", *RECOMMEND], capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    doc = json.loads(out.stdout) if out.returncode in (0, 1) and out.stdout.strip() else {}
    chosen = next((o for o in doc.get("options", []) if o["nodes"] == doc.get("chosen_nodes")), None)
    return {"command": "dtorch " + " ".join(RECOMMEND[:-1]), "wall_s": wall, "cpu_s": cpu, "rc": out.returncode,
            "chosen_gpus": chosen["gpus"] if chosen else None, "mfu": chosen["mfu"] if chosen else None,
            "tokens_per_step": chosen["tokens_per_step"] if chosen else None,
            "time_to_train_days": chosen["time_to_train_s"] / 86400 if chosen else None}


def as_plan(folders=(C.PUBLISHED_DIR, TESTING)) -> list[dict]:
    """Every bfloat16 row of `folders` priced as `dtorch plan --fix` prices it for a user who gives
    the published degrees (tp, pp, cp, virtual stages, micro-batch, recompute fixed; the data-parallel
    split, ZeRO, offload and the rest searched, shipped constants): DTorch's own executor (its
    selective policy, eager element-wise work, torch's SDPA), not the source's framework, which the
    described pricing (`C.predict`: the source's policy, fused kernels, attention kernel) models."""
    from dtorch.errors import ConfigError
    from dtorch.plan.plan import Plan
    from dtorch.plan.search import parse_fix, search

    out = []
    for folder in folders:
        if not folder.is_dir():
            continue
        _, rows, specs = C._load(str(folder))
        models = {n: C._profile(n, spec) for n, spec in specs}
        for r in rows:
            if r.dtype != "bfloat16":
                continue
            p = Plan(**r.plan)
            fix = {"tp": p.tp, "pp": p.pp, "cp": p.cp, "microbatch": p.microbatch_size, "ac": p.ac,
                   **({"virtual_stages": p.virtual_stages} if p.pp > 1 else {})}
            text = ",".join(f"{k}={v}" for k, v in fix.items())
            described = C.predict(r, models=models)[0] / r.tokens_per_s_per_gpu - 1.0
            row = {"row": r.name, "source": r.source, "fixed": text, "described_error": described}
            try:
                res = search(models[r.model], C._cluster(r.cluster), global_batch=p.dp * p.local_batch(),
                             fixed=parse_fix(text), top_k=1, dtype="bfloat16")
            except ConfigError as e:  # (a published layout DTorch's executor cannot take, as the CLI says it)
                out.append(row | {"error": None, "plan": f"refused: {e}"})
                continue
            if res.ranked:
                plan, est = res.ranked[0]
                row |= {"error": est.tokens_per_s_per_gpu / r.tokens_per_s_per_gpu - 1.0, "plan": plan.describe()}
            else:
                row |= {"error": None, "plan": "no plan fits: " + (res.suggestions[0] if res.suggestions else "")}
            out.append(row)
    return out


def as_plan_table(rows: list[dict]) -> str:
    lines = ["| row | source | described | as `dtorch plan --fix` | its plan |", "|---|---|---|---|---|"]
    for r in rows:
        err = f"{r['error']:+.1%}" if r["error"] is not None else "-"
        lines.append(f"| {r['row']} | {r['source']} | {r['described_error']:+.1%} | {err} | {r['plan']} |")
    priced = [r for r in rows if r["error"] is not None]
    mean = sum(abs(r["error"]) for r in priced) / max(1, len(priced))
    lines += ["", f"{len(priced)} of {len(rows)} rows priced, mean absolute error {mean:.1%}; "
              f"{len(rows) - len(priced)} not fitting or refused under DTorch's executor."]
    return "\n".join(lines)


QUICK_GRID = [(64.0, 16.0), (128.0, 16.0)]
"""`--quick`'s grid for procedure (2): the shipped constants and one other GEMM-width half point, so
the refit still chooses per fold (the same code path as `C.GRID`'s 12 points, in a sixth of the time)."""


def run(quick: bool = False, out_dir: Path = RESULTS) -> dict:
    grid = QUICK_GRID if quick else C.GRID
    t = time.perf_counter()
    fixed = C.loso()
    t_fixed = time.perf_counter() - t
    t = time.perf_counter()
    refit = C.loso(grid=grid)
    t_refit = time.perf_counter() - t
    full = C.fit()
    t = time.perf_counter()
    tested, tested_refit = testing(), testing(grid=grid)
    admitted = _admitted() if tested else {}
    t_testing = time.perf_counter() - t
    t = time.perf_counter()
    planned = as_plan()
    t_planned = time.perf_counter() - t
    result = {
        "host": platform.node(), "python": platform.python_version(), "quick": quick,
        "refit_grid": [list(p) for p in grid],
        "sources": [vars(s) for s in C.sources()],
        "fitted_on_every_source": {"efficiencies": full.efficiencies, "loss": full.loss},
        "loso_efficiencies_only": _held(fixed), "loso_seconds": t_fixed,
        "loso_refit_globals": _held(refit), "loso_refit_seconds": t_refit,
        "testing_sources": [vars(s) for s in C.sources(TESTING)],
        "testing_efficiencies_only": _held(tested), "testing_refit_globals": _held(tested_refit),
        "testing_before_fitting": [{"source": h.source, "mean_abs_error": h.before_mean_abs, "per_row": [
            {"row": r.name, "published": r.tokens_per_s_per_gpu, "predicted": p, "error": e} for r, p, e in h.before]}
            for h in tested],
        "if_testing_sources_joined_the_fit": admitted.get("held", []), "testing_seconds": t_testing,
        "as_plan_fix": planned, "as_plan_seconds": t_planned,
        "recommend": _recommend(),
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "published_loso.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "published_loso.md").write_text(markdown(result, fixed, refit, tested, tested_refit,
                                                         admitted.get("table", "")))
    return result


def markdown(result: dict, fixed: list[C.HeldOut], refit: list[C.HeldOut], tested=(), tested_refit=(),
             admitted: str = "") -> str:
    rec = result["recommend"]
    testing_part = [
        "Sources kept for testing first (`benchmarks/published/testing/`, never fitted): before any fitting "
        "and fitted on every source above, by procedure (1):", "", C.loso_table(tested), "",
        "and by procedure (2):", "", C.loso_table(tested_refit), "", "Per row, procedure (1):", "",
        C.loso_rows_table(tested), "",
        f"If they joined the fit, procedure (1) over all sources ({result['testing_seconds']:.1f} s for this "
        "part):", "", admitted, ""] if tested else []
    lines = ["# Published runs, leave-one-source-out", "",
             "(1) per fold, device efficiencies refit, global constants as shipped "
             f"({result['loso_seconds']:.1f} s):", "", C.loso_table(fixed), "",
             f"(2) per fold, the two global constants (GEMM-width half point, element-wise passes) refit too, over "
             f"{len(result['refit_grid'])} grid points{' (--quick)' if result['quick'] else ''} "
             f"({result['loso_refit_seconds']:.1f} s):", "",
             C.loso_table(refit), "", "Per row, procedure (1):", "", C.loso_rows_table(fixed), "",
             *testing_part,
             "(3) Every bfloat16 row as `dtorch plan --fix` prices it for a user who gives the published tp, pp, "
             "cp, virtual stages, micro-batch and recompute (the rest searched, shipped constants): DTorch's own "
             "executor (its selective policy, eager element-wise work, torch's SDPA), beside the described "
             f"pricing of the source's framework ({result['as_plan_seconds']:.1f} s):", "",
             as_plan_table(result["as_plan_fix"]), "",
             "Efficiencies fitted on every source: "
             + ", ".join(f"{d} {e:.4f}" for d, e in result["fitted_on_every_source"]["efficiencies"].items()), "",
             f"Sizing: `{rec['command']}` -> {rec['chosen_gpus']} GPUs, "
             + (f"{rec['mfu']:.1%} MFU, {rec['tokens_per_step']:,} tokens per step, "
                f"{rec['time_to_train_days']:.1f} days; " if rec["mfu"] else "")
             + f"{rec['wall_s']:.2f} s wall, {rec['cpu_s']:.2f} s CPU (fresh interpreter, imports included)", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_calibration", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="procedure (2) over 2 grid points instead of 12")
    p.add_argument("--out", default=str(RESULTS), help="results folder (default benchmarks/results)")
    a = p.parse_args(argv)
    run(quick=a.quick, out_dir=Path(a.out))
    print((Path(a.out) / "published_loso.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
