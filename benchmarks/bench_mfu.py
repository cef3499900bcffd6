"""(c) Single-process MFU on this machine's CPU.

One process with all the cores trains a small Llama through `dtorch.parallelize` with the one-rank
plan (forward + backward + AdamW). MFU = achieved model FLOP/s (tokens/s x the profile's training
FLOPs per token, 6N + 12 l h s, no recompute) over the CPU's peak detected from its features
(`dtorch.cluster.peak`, the denominator DTorch reports MFU against). For comparison, the achieved
rate is also given as a share of what GEMMs reach here (not MFU: a measured rate is no peak): the
best GEMM `dtorch probe` measured (when a one-process calibration is stored) and a 1024^3 fp32 GEMM
measured now (`dtorch.monitor.metrics.measured_gemm_rate`).

    python -m benchmarks --only mfu [--quick]
"""

from __future__ import annotations

import statistics
import time
from typing import Any

MODEL = "llama-tiny:hidden=256,heads=8,kv_heads=4,layers=4,seq=256"
SEQ = 256
BATCH = 4


def run(quick: bool = False, log=print) -> dict[str, Any]:
    import torch

    from dtorch.cluster.peak import cpu_peak
    from dtorch.cluster.probe import stored_calibration
    from dtorch.model import profile_module
    from dtorch.models import build_model, model_config
    from dtorch.monitor.metrics import measured_gemm_rate
    from dtorch.parallel.parallelize import parallelize
    from dtorch.plan.plan import Plan
    from dtorch.train.losses import next_token

    prev = torch.get_num_threads()
    steps = 3 if quick else 8
    log(f"mfu: {MODEL} batch {BATCH} x seq {SEQ}, {steps} timed steps, {torch.get_num_threads()} threads")
    factory = lambda: build_model(MODEL)  # noqa: E731
    profile = profile_module(factory, SEQ)
    plan = Plan(microbatch_size=BATCH, num_microbatches=1, param_dtype="float32", global_batch=BATCH, seq_len=SEQ)
    pm = parallelize(factory, plan, loss_fn=next_token, device="cpu", seed=0, seq_len=SEQ)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    vocab = model_config(MODEL).vocab_size
    x = torch.randint(vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    times = []
    for i in range(steps + 2):
        t = time.perf_counter()
        pm.forward_backward(inputs, labels)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t)
    step = statistics.median(times)
    achieved = BATCH * SEQ * profile.flops_per_token / step
    gemm_now = measured_gemm_rate(torch.device("cpu"), torch.float32, 1024)
    cal = stored_calibration("local:1x1")
    probe_peak = (cal or {}).get("device", {}).get("measured_peak_flops", {}).get("float32")
    detected = cpu_peak("float32")
    torch.set_num_threads(prev)
    return {
        "config": {"model": MODEL, "seq_len": SEQ, "batch": BATCH, "steps": steps, "threads": torch.get_num_threads()},
        "step_time_s": step, "step_times_s": times, "tokens_per_s": BATCH * SEQ / step,
        "flops_per_token": profile.flops_per_token, "achieved_flops": achieved,
        "peaks": {"probe_best_gemm": probe_peak, "gemm_1024_now": gemm_now, "detected": detected.flops},
        "detected_peak": detected.describe(),
        "mfu": {"vs_probe_best_gemm": achieved / probe_peak if probe_peak else None,
                "vs_gemm_1024_now": achieved / gemm_now, "vs_detected": achieved / detected.flops},
    }


def markdown(r: dict) -> str:
    c = r["config"]
    lines = ["## (c) Single-process MFU", "",
             f"`{c['model']}`, batch {c['batch']} x seq {c['seq_len']}, {c['threads']} threads, median of {c['steps']} steps: "
             f"{r['step_time_s'] * 1e3:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, "
             f"{r['achieved_flops'] / 1e9:.2f} GFLOP/s achieved.", "",
             f"MFU {r['mfu']['vs_detected']:.1%} of the detected peak ({r['detected_peak']}).", "",
             "| against | GFLOP/s | achieved / it |", "|---|---|---|"]
    for k, label in (("detected", "detected peak (MFU)"), ("probe_best_gemm", "best GEMM measured by dtorch probe"),
                     ("gemm_1024_now", "1024^3 fp32 GEMM measured now")):
        peak = r["peaks"][k]
        mfu = r["mfu"]["vs_" + k]
        lines.append(f"| {label} | {'n/a' if peak is None else f'{peak / 1e9:.1f}'} | "
                     f"{'n/a' if mfu is None else f'{mfu:.1%}'} |")
    return "\n".join(lines) + "\n"
