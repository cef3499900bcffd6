"""Expert-parallel token dispatch and combine, measured at world 2 and 4 (gloo on CPU, nccl on GPU).

    python -m benchmarks.bench_moe_dispatch            # writes benchmarks/results/moe_dispatch.{json,md}
    python -m benchmarks.bench_moe_dispatch --quick    # fewer sizes and repetitions
    python -m benchmarks.bench_moe_dispatch --predict-only  # add the planner's prediction to the stored run

One MoE layer's communication, as dtorch.parallel.expert runs it: a real router (random weights,
top-k of n_experts) routes each rank's tokens, then per step
  counts    all_to_all_single of the per-expert counts (n_experts int64),
  dispatch  all_to_all_single of the assignments' hidden states with variable splits (`exchange`,
            timed apart), then the local regroup into expert-major order,
  combine   the reverse all_to_all_single (the expert computation in between is the identity here,
            so that only the communication and the regrouping are timed),
  backward  the two all-to-alls again, in reverse, on the gradients.
Recorded per (world, tokens per rank, hidden): the median time of each phase over the repetitions
(every repetition starts at a barrier), and the bytes each rank sends to *other* ranks per
direction (rows routed to experts held elsewhere x hidden x element size; the combine sends as many
back, and backward repeats both), so that the planner's all-to-all cost can be checked against
these figures once it exists. The effective bandwidth is those bytes over the phase time.
Timings on a shared machine are noisy: compare within one run.

`run(quick=False) -> dict` is the entry point for a benchmark runner.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
WORLDS = (2, 4)
SIZES = ((1024, 256), (4096, 256), (4096, 1024))
QUICK_SIZES = ((1024, 256), (4096, 512))
NUM_EXPERTS, TOP_K = 8, 2


def _worker(payload: dict, rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from dtorch.parallel.expert import _AllToAll, _expert_major, dispatch_bytes

    dev = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    group = dist.group.WORLD
    local = NUM_EXPERTS // world
    rows = []
    for tokens, hidden in payload["sizes"]:
        g = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(tokens, hidden, generator=g).to(dev)
        router = torch.randn(hidden, NUM_EXPERTS, generator=torch.Generator().manual_seed(7)).to(dev)
        idx = (x @ router).topk(TOP_K, dim=-1).indices.reshape(-1)
        order = idx.argsort(stable=True)
        counts = torch.bincount(idx, minlength=NUM_EXPERTS).tolist()
        sorted_x = x[order // TOP_K]
        times: dict[str, list[float]] = {"counts": [], "dispatch": [], "combine": [], "backward": [],
                                         "exchange": []}
        for rep in range(payload["warmup"] + payload["reps"]):
            inp = sorted_x.detach().requires_grad_()
            dist.barrier()
            t0 = time.perf_counter()
            send = torch.tensor(counts, dtype=torch.int64, device=dev)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=group)
            send_m, recv_m = send.view(world, local).cpu(), recv.view(world, local).cpu()
            in_splits, out_splits = send_m.sum(1).tolist(), recv_m.sum(1).tolist()
            t1 = time.perf_counter()
            received = _AllToAll.apply(inp, out_splits, in_splits, group)
            _sync(dev)
            t1x = time.perf_counter()  # the exchange alone; the rest of dispatch is the local regroup
            perm = _expert_major(recv_m).to(dev)
            y = received[perm]  # identity "experts" in expert-major order
            _sync(dev)
            t2 = time.perf_counter()
            back = torch.empty_like(perm)
            back[perm] = torch.arange(perm.numel(), device=dev)
            out = _AllToAll.apply(y[back], in_splits, out_splits, group)
            _sync(dev)
            t3 = time.perf_counter()
            out.backward(torch.ones_like(out))
            _sync(dev)
            t4 = time.perf_counter()
            assert torch.equal(out, inp.detach()) and torch.equal(inp.grad, torch.ones_like(inp))  # round trip
            if rep >= payload["warmup"]:
                for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t1x - t1)):
                    times[k].append(dt)
        sent = dispatch_bytes(counts, hidden, x.element_size(), rank, world)
        rows.append({"tokens": tokens, "hidden": hidden, "assignments": tokens * TOP_K,
                     "bytes_sent_per_direction": sent,
                     **{f"{k}_s": statistics.median(v) for k, v in times.items()}})
    return {"rank": rank, "rows": rows}


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run(quick: bool = False) -> dict:
    from benchmarks._group import run_group, threads_per_rank

    payload = {"sizes": QUICK_SIZES if quick else SIZES, "warmup": 2 if quick else 3, "reps": 5 if quick else 15}
    results = []
    load_before = os.getloadavg()[0]
    for world in WORLDS:
        per_rank = run_group(world, _worker, payload, timeout_s=300.0)
        errors = [r["error"] for r in per_rank if "error" in r]
        if errors:
            raise RuntimeError(errors[0])
        for i, (tokens, hidden) in enumerate(payload["sizes"]):
            rows = [r["rows"][i] for r in per_rank]
            slowest = {k: max(r[k] for r in rows) for k in ("counts_s", "dispatch_s", "combine_s", "backward_s",
                                                             "exchange_s")}
            sent = [r["bytes_sent_per_direction"] for r in rows]
            # per step and MoE layer: dispatch + combine forward, and both again in backward
            step_bytes = 4 * sum(sent)
            comm_s = slowest["dispatch_s"] + slowest["combine_s"] + slowest["backward_s"]
            results.append({
                "world": world, "ep": world, "tokens_per_rank": tokens, "hidden": hidden, "top_k": TOP_K,
                "num_experts": NUM_EXPERTS, "dtype": "float32", "threads_per_rank": threads_per_rank(world),
                **{k: v for k, v in slowest.items()},
                "bytes_sent_per_rank_per_direction": sent,
                "off_rank_fraction": sum(sent) / (world * tokens * TOP_K * hidden * 4),
                "bytes_moved_per_step_all_ranks": step_bytes,
                "effective_GBps_per_rank": (max(sent) / max(slowest["dispatch_s"], 1e-9)) / 1e9,
                "comm_s_per_step": comm_s,
            })
    return {"host": platform.node(), "python": platform.python_version(), "quick": quick, "cpus": os.cpu_count(),
            "load_avg_1min": [load_before, os.getloadavg()[0]],
            "note": "medians of repetitions, slowest rank per phase", "rows": results}


def predict(res: dict) -> dict:
    """Add the planner's prediction to every row: one all-to-all of the rank's assignments
    (`dtorch.plan.strategies.expert.all_to_all_time`) over this machine's links as `dtorch probe`
    measured them (`local_cluster(world)` with the calibration in benchmarks/results/calibration,
    which `python -m benchmarks --only probe` writes; the `cpu:1x<world>` preset's links where
    there is none), and the measured/predicted ratio of dispatch and of the whole per-step exchange
    (the planner prices backward as two more all-to-alls, so a step is 4 of them; the count
    exchange apart)."""
    from dtorch.cluster import local_cluster
    from dtorch.plan.strategies.expert import all_to_all_time

    os.environ.setdefault("DTORCH_CALIBRATION_DIR", str(RESULTS / "calibration"))
    sources = set()
    for r in res["rows"]:
        cluster = local_cluster(r["world"])
        g = cluster.groups[0]
        sources.add("probed" if cluster.calibration.get("version") else "preset")
        nbytes = r["tokens_per_rank"] * r["top_k"] * r["hidden"] * 4  # float32
        one = all_to_all_time(nbytes, r["ep"], 1, g)
        r["predicted_dispatch_s"] = one
        r["predicted_comm_s_per_step"] = 4 * one
        r["dispatch_measured_over_predicted"] = r["dispatch_s"] / one
        if "exchange_s" in r:  # the dispatch's all_to_all_single alone (runs before this field lack it)
            r["exchange_measured_over_predicted"] = r["exchange_s"] / one
        r["step_measured_over_predicted"] = r["comm_s_per_step"] / (4 * one)
        r["link"] = {"bandwidth": g.intra.bandwidth, "latency": g.intra.latency,
                     "a2a_bandwidth": g.intra.a2a_bandwidth, "a2a_latency": g.intra.a2a_latency}
    how = ("the links `dtorch probe` measured on this host (benchmarks/results/calibration)" if sources == {"probed"}
           else "the cpu:1x<world> preset's links (not probed on this host)")
    res["prediction"] = f"dtorch.plan.strategies.expert.all_to_all_time over {how}"
    return res


def _markdown(res: dict) -> str:
    lines = ["# MoE dispatch/combine (expert parallelism), measured", "",
             f"Host {res['host']} ({res['cpus']} CPUs, 1-min load average {res['load_avg_1min'][0]:.1f} before, "
             f"{res['load_avg_1min'][1]:.1f} after, this benchmark's ranks included), {res['note']}. Per MoE layer and step; bytes are what each rank sends to other "
             "ranks in one direction (dispatch; combine sends the same back; backward repeats both).", "",
             "| world=ep | tokens/rank | hidden | off-rank | bytes/rank/direction | counts ms | dispatch ms | "
             "combine ms | backward ms | GB/s/rank |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['world']} | {r['tokens_per_rank']} | {r['hidden']} | {r['off_rank_fraction']:.2f} | "
                     f"{max(r['bytes_sent_per_rank_per_direction']):,} | {1e3 * r['counts_s']:.2f} | "
                     f"{1e3 * r['dispatch_s']:.2f} | {1e3 * r['combine_s']:.2f} | {1e3 * r['backward_s']:.2f} | "
                     f"{r['effective_GBps_per_rank']:.2f} |")
    if "prediction" in res:
        lines += ["", f"Predicted ({res['prediction']}). Exchange: the dispatch's all_to_all_single alone "
                  "(dispatch = exchange + the local regroup into expert-major order, which the planner does not price):", "",
                  "| world=ep | tokens/rank | hidden | predicted dispatch ms | measured exchange ms | "
                  "measured/predicted exchange | measured/predicted dispatch | "
                  "predicted step ms (4 all-to-alls) | measured/predicted step |", "|---|---|---|---|---|---|---|---|---|"]
        for r in res["rows"]:
            ex = (f"{1e3 * r['exchange_s']:.2f} | {r['exchange_measured_over_predicted']:.2f}" if "exchange_s" in r
                  else "- | -")
            lines.append(f"| {r['world']} | {r['tokens_per_rank']} | {r['hidden']} | {1e3 * r['predicted_dispatch_s']:.2f} | "
                         f"{ex} | {r['dispatch_measured_over_predicted']:.2f} | {1e3 * r['predicted_comm_s_per_step']:.2f} | "
                         f"{r['step_measured_over_predicted']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--predict-only", action="store_true",
                    help="add the planner's prediction to the stored measurement instead of measuring again")
    args = ap.parse_args()
    res = json.loads((RESULTS / "moe_dispatch.json").read_text()) if args.predict_only else run(quick=args.quick)
    res = predict(res)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "moe_dispatch.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / "moe_dispatch.md").write_text(_markdown(res))
    print(_markdown(res))


if __name__ == "__main__":
    main()
