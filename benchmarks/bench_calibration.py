"""The cost model against published runs, leave-one-source-out (benchmarks/published/*.yaml).

    python -m benchmarks.bench_calibration     # writes benchmarks/results/published_loso.{json,md}

Two procedures, side by side: (1) per held-out source, refit the per-device matmul efficiencies on
the other sources, global constants as shipped; (2) refit the two global constants too. Also the
sizing example (`dtorch plan --model llama3-405b --recommend ...`) with its wall time. Pure CPU.

`run() -> dict` is the entry point for a benchmark runner.
"""

from __future__ import annotations

import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from dtorch.plan import calibration as C

RESULTS = Path(__file__).resolve().parent / "results"
RECOMMEND = ["plan", "--model", "llama3-405b", "--recommend", "--device-type", "h100", "--tokens", "15T",
             "--deadline", "60d", "--json"]


def _held(res: list[C.HeldOut]) -> list[dict]:
    return [{"source": h.source, "rows": len(h.rows), "mean_abs_error": h.mean_abs, "mean_signed_error": h.mean_signed,
             "max_abs_error": h.max_abs, "borrowed": dict(h.fit.borrowed), "efficiencies": dict(h.fit.efficiencies),
             "per_row": [{"row": r.name, "published": r.tokens_per_s_per_gpu, "predicted": p, "error": e}
                         for r, p, e in h.rows]} for h in res]


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


def run() -> dict:
    t = time.perf_counter()
    fixed = C.loso()
    t_fixed = time.perf_counter() - t
    t = time.perf_counter()
    refit = C.loso(grid=C.GRID)
    t_refit = time.perf_counter() - t
    full = C.fit()
    result = {
        "host": platform.node(), "python": platform.python_version(),
        "sources": [vars(s) for s in C.sources()],
        "fitted_on_every_source": {"efficiencies": full.efficiencies, "loss": full.loss},
        "loso_efficiencies_only": _held(fixed), "loso_seconds": t_fixed,
        "loso_refit_globals": _held(refit), "loso_refit_seconds": t_refit,
        "recommend": _recommend(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "published_loso.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "published_loso.md").write_text(markdown(result, fixed, refit))
    return result


def markdown(result: dict, fixed: list[C.HeldOut], refit: list[C.HeldOut]) -> str:
    rec = result["recommend"]
    lines = ["# Published runs, leave-one-source-out", "",
             "(1) per fold, device efficiencies refit, global constants as shipped "
             f"({result['loso_seconds']:.1f} s):", "", C.loso_table(fixed), "",
             f"(2) per fold, the two global constants (GEMM-width half point, element-wise passes) refit too ({result['loso_refit_seconds']:.1f} s):", "",
             C.loso_table(refit), "", "Per row, procedure (1):", "", C.loso_rows_table(fixed), "",
             "Efficiencies fitted on every source: "
             + ", ".join(f"{d} {e:.4f}" for d, e in result["fitted_on_every_source"]["efficiencies"].items()), "",
             f"Sizing: `{rec['command']}` -> {rec['chosen_gpus']} GPUs, "
             + (f"{rec['mfu']:.1%} MFU, {rec['tokens_per_step']:,} tokens per step, "
                f"{rec['time_to_train_days']:.1f} days; " if rec["mfu"] else "")
             + f"{rec['wall_s']:.2f} s wall, {rec['cpu_s']:.2f} s CPU (fresh interpreter, imports included)", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    r = run()
    print((RESULTS / "published_loso.md").read_text())
