"""Planner speed: search time vs cluster size (64 -> 16,384 H100s) for llama3-70b and llama3-405b,
and the wall time of the whole `dtorch plan` command. Pure CPU; no GPU needed.

    python benchmarks/bench_planner.py      # writes benchmarks/results/planner.{json,md}

`run() -> dict` is the entry point for a benchmark runner.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dtorch.cluster.load import load_cluster
from dtorch.plan.profiles import get_profile
from dtorch.plan.search import search

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = [64, 256, 1024, 4096, 16384]
MODELS = ["llama3-70b", "llama3-405b"]
SEQ = 8192


def _cli_wall(args: list[str], repeats: int = 3) -> float:
    """Median wall seconds of `dtorch plan ...` in a fresh interpreter (imports included)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import sys; from dtorch.cli import main; sys.exit(main(sys.argv[1:]))",
                        *args], check=True, capture_output=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(sizes: list[int] | None = None, models: list[str] | None = None, repeats: int = 2,
        out_dir: Path = RESULTS) -> dict:
    """Search time per (model, GPUs) and CLI wall times; returns the results dict (also written to
    `out_dir`/planner.json and .md)."""
    rows = []
    for model in models or MODELS:
        profile = get_profile(model, SEQ)
        for gpus in sizes or SIZES:
            cluster = load_cluster(f"h100:{gpus // 8}x8")
            gb = max(512, gpus // 8)
            secs = []
            for _ in range(repeats):
                t = time.perf_counter()
                r = search(profile, cluster, global_batch=gb, top_k=5)
                secs.append(time.perf_counter() - t)
            best = r.best
            rows.append({
                "model": model, "gpus": gpus, "global_batch": gb, "seq_len": SEQ,
                "search_s": min(secs), "meshes": r.meshes, "meshes_pruned": r.meshes_pruned,
                "plans_evaluated": r.evaluated,
                "best_plan": best[0].describe() if best else None,
                "tokens_per_s_per_gpu": best[1].tokens_per_s_per_gpu if best else None,
                "mfu": best[1].mfu if best else None,
            })
    cli = {
        "llama3-70b h100:8x8 (seq 8192, gb 512)": _cli_wall(
            ["plan", "--model", "llama3-70b", "--cluster", "h100:8x8", "--seq-len", "8192", "--global-batch", "512"]),
        "llama3-405b h100:2048x8 (seq 8192, gb 2048)": _cli_wall(
            ["plan", "--model", "llama3-405b", "--cluster", "h100:2048x8", "--seq-len", "8192",
             "--global-batch", "2048"]),
    }
    result = {"machine": f"{platform.processor() or platform.machine()}, python {platform.python_version()}",
              "search": rows, "cli_wall_s": cli}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "planner.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "planner.md").write_text(markdown(result))
    return result


def markdown(result: dict) -> str:
    lines = ["# Planner speed", "", f"Machine: {result['machine']}. Search time is the best of the repeats.", "",
             "| model | GPUs | global batch | search s | meshes | pruned | plans | best plan | tok/s/GPU | MFU |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in result["search"]:
        lines.append(f"| {r['model']} | {r['gpus']:,} | {r['global_batch']} | {r['search_s']:.2f} | {r['meshes']} | "
                     f"{r['meshes_pruned']} | {r['plans_evaluated']:,} | {r['best_plan']} | "
                     f"{r['tokens_per_s_per_gpu'] or 0:,.0f} | {(r['mfu'] or 0):.1%} |")
    lines += ["", "| whole `dtorch plan` command | wall s (median of 3) |", "|---|---:|"]
    for k, v in result["cli_wall_s"].items():
        lines.append(f"| {k} | {v:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(run()))
