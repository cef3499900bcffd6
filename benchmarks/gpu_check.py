"""One-GPU checks of the planner against the machine (run by scripts/gpu_check.sh, < 8 minutes).

For a ~1B and a ~8B Llama: the planner's 1-GPU plan for this GPU (`local_cluster(1)`, the spec
sheet of the detected device), applied with `dtorch.parallelize` and trained on random tokens for a
few steps with AdamW; measured step time, MFU (over the bf16 peak of the spec sheet) and the CUDA
allocator's peak beside the prediction. Then the CUDA path of every one-GPU option on a tiny model:
activation checkpointing none/selective/full x float32/bfloat16, with the dtype of the matmuls
checked. Writes benchmarks/results/gpu_check.json and .md.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = (("llama3-1b", 4096, 8), ("llama3-8b", 4096, 8))
STEPS = 8


def _train(spec: str, plan, seq: int, steps: int) -> dict[str, Any]:
    import torch

    from dtorch.models import build_model, model_config
    from dtorch.parallel.parallelize import parallelize
    from dtorch.train.losses import next_token

    torch.cuda.reset_peak_memory_stats()
    pm = parallelize(lambda: build_model(spec), plan, loss_fn=next_token, device="cuda", seed=0, seq_len=seq)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-5, fused=True)
    vocab = model_config(spec).vocab_size
    batch = plan.microbatch_size * plan.num_microbatches
    x = torch.randint(vocab, (batch, seq + 1), device="cuda")
    times = []
    for i in range(steps + 2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        pm.forward_backward(x[:, :-1], x[:, 1:])
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t)
    out = {"step_time_s": statistics.median(times), "peak_memory_bytes": int(torch.cuda.max_memory_allocated())}
    del pm, opt
    torch.cuda.empty_cache()
    return out


def _planned(spec: str, seq: int, batch: int, log) -> dict[str, Any]:
    from dtorch.cluster import local_cluster
    from dtorch.plan.profiles import get_profile
    from dtorch.plan.search import search

    cluster = local_cluster(1)
    prof = get_profile(spec, seq)
    res = search(prof, cluster, global_batch=batch, top_k=1)
    if res.best is None:
        return {"model": spec, "fits": False, "suggestions": res.suggestions}
    plan, est = res.best
    plan.seq_len, plan.global_batch = seq, batch
    row = {"model": spec, "plan": plan.describe(), "predicted_step_time_s": est.step_time_s,
           "predicted_mfu": est.mfu, "predicted_memory_bytes": est.memory_bytes_per_rank}
    try:
        got = _train(spec, plan, seq, STEPS)
    except Exception as e:  # noqa: BLE001 - an OOM or a failure is a result too
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return row
    peak = cluster.groups[0].device.peak("bfloat16")
    row.update(got, measured_mfu=batch * seq * prof.flops_per_token / got["step_time_s"] / peak,
               time_ratio=got["step_time_s"] / est.step_time_s,
               memory_ratio=got["peak_memory_bytes"] / est.memory_bytes_per_rank)
    log(f"{spec}: {row['plan']} predicted {est.step_time_s:.2f} s, measured {got['step_time_s']:.2f} s, "
        f"MFU {row['measured_mfu']:.1%}, peak {got['peak_memory_bytes'] / 2**30:.1f} GiB")
    return row


def _options(log) -> list[dict[str, Any]]:
    import torch

    from dtorch.models import build_model
    from dtorch.parallel.parallelize import parallelize
    from dtorch.plan.plan import Plan
    from dtorch.train.losses import next_token

    rows = []
    for dtype in ("float32", "bfloat16"):
        for ac in ("none", "selective", "full"):
            plan = Plan(microbatch_size=2, num_microbatches=2, ac=ac, param_dtype=dtype, global_batch=4, seq_len=128)
            pm = parallelize(lambda: build_model("llama-tiny"), plan, loss_fn=next_token, device="cuda", seed=0,
                             seq_len=128)
            x = torch.randint(256, (4, 129), device="cuda")
            seen: set[torch.dtype] = set()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                loss = pm.forward_backward(x[:, :-1], x[:, 1:])
            torch.cuda.synchronize()
            for p in pm.parameters():
                seen.add(p.dtype)
            ok = bool(torch.isfinite(torch.as_tensor(loss)).item())
            kernels = sum(1 for e in prof.key_averages() if "gemm" in e.key.lower() or "bf16" in e.key.lower())
            rows.append({"param_dtype": dtype, "ac": ac, "loss_finite": ok, "gemm_kernels": kernels,
                         "master_dtypes": sorted(str(d) for d in seen)})
            log(f"option ac={ac} {dtype}: loss finite {ok}")
    return rows


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here", file=sys.stderr)
        return 2
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "models": [_planned(spec, seq, batch, log) for spec, seq, batch in MODELS],
              "options": _options(log)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"## One-GPU check on {result['device']} (torch {result['torch']})", "",
             "| model | plan | predicted s | measured s | ratio | MFU | peak GiB | predicted GiB |", "|---|---|---|---|---|---|---|---|"]
    for r in result["models"]:
        if "step_time_s" in r:
            lines.append(f"| {r['model']} | `{r['plan']}` | {r['predicted_step_time_s']:.2f} | {r['step_time_s']:.2f} | "
                         f"{r['time_ratio']:.2f} | {r['measured_mfu']:.1%} | {r['peak_memory_bytes'] / 2**30:.1f} | "
                         f"{r['predicted_memory_bytes'] / 2**30:.1f} |")
        else:
            lines.append(f"| {r['model']} | {r.get('plan', '-')} | - | - | - | - | - | {r.get('error') or r.get('suggestions')} |")
    (RESULTS / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
