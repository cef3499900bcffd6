"""Start-up cost per rank: rank-local initialisation and pretrained-weight loading (CPU, gloo).

1. A >= 1B-parameter model (default: the llama3-1b preset, 1.50e9 parameters, 6.0 GB in fp32)
   started at world 4 under FSDP (dp_shard=4) and FSDP x TP (dp_shard=2, tp=2): peak host RSS
   per rank over the whole process (imports included) against the target
   0.4 x model bytes + 300 MB, and the wall time of `parallelize`.
2. Side by side on a smaller model (default ~250M): the same start-up through the seed path
   (one full CPU copy per rank, what every model did before rank-local initialisation).
3. Loading a Hugging Face safetensors directory of that smaller model (written once, bf16) at
   world 4 (FSDP) and world 2 (FSDP): load time, bytes read and peak RSS per rank.

    .venv/bin/python -m benchmarks.bench_startup [--big llama3-1b] [--small SPEC] [--skip-big]

Writes benchmarks/results/startup.json and startup.md. Mind the host memory: the big case holds
about 4 x (model / 4 + 0.4 GB) at once.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from benchmarks._group import peak_rss, run_group

RESULTS = Path(__file__).parent / "results"
BIG = "llama3-1b"
SMALL = "llama:layers=12,hidden=1024,heads=16,kv_heads=8,ffn=4096,vocab=32000,seq=2048"
MB = 1e6


def _worker(payload: dict, rank: int, world: int) -> dict:
    import torch

    from dtorch.models import build_model
    from dtorch.parallel.parallelize import parallelize
    from dtorch.plan.plan import Plan
    from dtorch.train.losses import next_token

    spec, seed_path = payload["model"], payload.get("seed_path", False)

    def factory():
        m = build_model(spec)
        if seed_path:
            m.rank_local_init = False  # force the full-copy path, for comparison
        return m

    weights = None
    if payload.get("init_from"):
        from dtorch.checkpoint.hf_weights import HFWeights

        weights = HFWeights(payload["init_from"])
    base = peak_rss()
    t = time.perf_counter()
    pm = parallelize(factory, Plan(**payload["plan"]), loss_fn=next_token, seq_len=128, weights=weights)
    wall = time.perf_counter() - t
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in pm.parameters())
    torch.distributed.barrier()
    return {"rank": rank, "wall_s": wall, "peak_rss_bytes": peak_rss(), "rss_before_bytes": base,
            "bytes_read": pm.startup["bytes_read"], "path": pm.startup["path"], "local_params": local}


def _case(name: str, spec: str, plan: dict, **extra) -> dict:
    world = 1
    for k in ("dp_shard", "dp_replicate", "tp", "pp", "cp"):
        world *= plan.get(k, 1)
    t = time.perf_counter()
    ranks = run_group(world, _worker, {"model": spec, "plan": plan, **extra}, timeout_s=900)
    total_wall = time.perf_counter() - t
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        raise RuntimeError(errors[0])
    n = _params(spec)
    model_bytes = 4 * n
    peak = max(r["peak_rss_bytes"] for r in ranks)
    target = 0.4 * model_bytes + 300 * MB
    return {"case": name, "model": spec, "params": n, "model_bytes": model_bytes, "plan": plan, "world": world,
            "path": ranks[0]["path"], "peak_rss_bytes_max": peak, "peak_rss_over_model": peak / model_bytes,
            "target_bytes": target, "meets_target": peak <= target,
            "rss_before_bytes_max": max(r["rss_before_bytes"] for r in ranks),
            "parallelize_wall_s_max": max(r["wall_s"] for r in ranks), "job_wall_s": total_wall,
            "bytes_read_per_rank": [r["bytes_read"] for r in ranks], "ranks": ranks}


def _params(spec: str) -> int:
    import torch

    from dtorch.models import build_model

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(spec).parameters())


def _write_hf(spec: str, out: Path) -> Path:
    """The model of `spec`, initialised once on CPU, written as a bf16 Hugging Face directory."""
    import torch
    from safetensors.torch import save_file

    from dtorch.checkpoint import hf_weights as H
    from dtorch.models import build_model, model_config

    cfg = model_config(spec)
    with torch.device("meta"):
        meta = build_model(spec)
    shapes = {n: tuple(p.shape) for n, p in meta.named_parameters()}
    model = build_model(spec)  # CPU, seed 0
    sd = dict(model.named_parameters())
    plan = H.hf_tensor_plan("llama", shapes)
    out.mkdir(parents=True, exist_ok=True)
    names, shard, size, weight_map, i = list(plan), {}, 0, {}, 0

    def flush() -> None:
        nonlocal shard, size, i
        if shard:
            i += 1
            fname = f"model-{i:05d}.safetensors"
            save_file(shard, str(out / fname))
            weight_map.update(dict.fromkeys(shard, fname))
            shard, size = {}, 0

    for hf in names:
        t = H.to_hf([(r, sd[n].detach()) for r, n in plan[hf]], cfg).to(torch.bfloat16)
        shard[hf] = t
        size += t.numel() * 2
        if size > 200 * MB:
            flush()
    flush()
    (out / H.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(H.hf_config(cfg, "llama")))
    del model, sd
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big", default=BIG)
    ap.add_argument("--small", default=SMALL)
    ap.add_argument("--skip-big", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cases = []
    if not args.skip_big:
        cases.append(_case("big_fsdp4_rank_local", args.big, {"dp_shard": 4}))
        cases.append(_case("big_fsdp2_x_tp2_rank_local", args.big, {"dp_shard": 2, "tp": 2, "sp": True}))
    cases.append(_case("small_fsdp4_rank_local", args.small, {"dp_shard": 4}))
    cases.append(_case("small_fsdp4_seed_path", args.small, {"dp_shard": 4}, seed_path=True))
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        t = time.perf_counter()
        hf = _write_hf(args.small, Path(tmp) / "hf")
        write_s = time.perf_counter() - t
        cases.append(_case("small_load_hf_world4_fsdp", args.small, {"dp_shard": 4}, init_from=str(hf)))
        cases.append(_case("small_load_hf_world2_fsdp", args.small, {"dp_shard": 2}, init_from=str(hf)))
        ckpt_bytes = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    result = {"machine": platform.node(), "cpus": os.cpu_count(), "note": "CPU, gloo, a shared and loaded machine",
              "hf_dir_bytes": ckpt_bytes, "hf_write_s": write_s, "cases": cases}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "startup.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Start-up per rank (CPU, gloo; figures from a shared, loaded machine)", "",
             "| case | params | world | path | peak RSS/rank (MB) | target (MB) | peak/model | parallelize (s) "
             "| read/rank (MB) |", "|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        lines.append(f"| {c['case']} | {c['params'] / 1e9:.2f}e9 | {c['world']} | {c['path']} | "
                     f"{c['peak_rss_bytes_max'] / MB:,.0f} | {c['target_bytes'] / MB:,.0f} | "
                     f"{c['peak_rss_over_model']:.2f} | {c['parallelize_wall_s_max']:.1f} | "
                     f"{max(c['bytes_read_per_rank']) / MB:,.0f} |")
    lines += ["", f"The Hugging Face directory (bf16) holds {ckpt_bytes / MB:,.0f} MB; "
              "each loading rank reads its slices only. Target: 0.4 x fp32 model bytes + 300 MB.", ""]
    (RESULTS / "startup.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
