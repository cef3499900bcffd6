"""(b) Overhead: DTorch-applied plans against hand-written scripts that call PyTorch's own APIs
directly for the same strategy, model and batch: DDP (`DistributedDataParallel`), FSDP2
(`fully_shard` per block), TP (`parallelize_module`, vocabulary-parallel embedding/output with
`loss_parallel`), and FSDP x TP on a 2-D mesh.

Both sides run in ONE group of spawned processes, side by side: for every repetition and
strategy, the DTorch run and the hand-written run are built, warmed up, timed and torn down in
alternating order. Step = forward + backward + AdamW step + a loss all-reduce for logging (as
any training loop does; DTorch's forward_backward does it too). Ratio = median DTorch step time /
median hand-written step time.

    python -m benchmarks --only overhead [--quick]
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks import stats
from benchmarks._group import run_group

MODEL = "llama-tiny:hidden=128,heads=8,kv_heads=4,layers=4,seq=128"
SEQ = 128
GLOBAL_BATCH = 8
STRATEGIES = {  # name -> DTorch plan fields at world size 4
    "DDP": {"dp_replicate": 4},
    "FSDP": {"dp_shard": 4},
    "TP": {"tp": 4},
    "FSDPxTP": {"dp_shard": 2, "tp": 2},
}


def _hand_tp(model, tp_mesh) -> None:
    """Megatron-style TP written directly against PyTorch's API (no sequence parallelism)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        })


def _build_hand(name: str, spec: str, device, world: int):
    """(step function, local batch) of the hand-written script for strategy `name`."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.nn.parallel import DistributedDataParallel

    from dtorch.models import build_model
    from dtorch.train.losses import next_token

    model = build_model(spec).to(device)
    ctx = contextlib.nullcontext
    if name == "DDP":
        model = DistributedDataParallel(model)
        dp_rank, dp = dist.get_rank(), world
    elif name == "FSDP":
        mesh = init_device_mesh(device.type, (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        dp_rank, dp = dist.get_rank(), world
    elif name == "TP":
        _hand_tp(model, init_device_mesh(device.type, (world,)))
        ctx = loss_parallel
        dp_rank, dp = 0, 1
    else:  # FSDPxTP
        mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))
        _hand_tp(model, mesh["tp"])
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        ctx = loss_parallel
        dp_rank, dp = mesh["dp"].get_local_rank(), world // 2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(inputs, labels):
        with ctx():
            loss = next_token(model(inputs), labels)
            loss.backward()
        buf = (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach().clone()
        dist.all_reduce(buf)  # the mean loss every training loop logs
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, GLOBAL_BATCH // dp, dp_rank, (model, opt)


def _build_dtorch(name: str, spec: str, device, world: int):
    import torch

    from dtorch.models import build_model
    from dtorch.parallel.parallelize import parallelize
    from dtorch.plan.plan import Plan
    from dtorch.train.losses import next_token

    fields = STRATEGIES[name]
    dp = fields.get("dp_replicate", 1) * fields.get("dp_shard", 1)
    plan = Plan(**fields, microbatch_size=GLOBAL_BATCH // dp, num_microbatches=1, param_dtype="float32",
                global_batch=GLOBAL_BATCH, seq_len=SEQ)
    pm = parallelize(lambda: build_model(spec), plan, loss_fn=next_token, device=device, seed=0, seq_len=SEQ)
    opts = [torch.optim.AdamW(p.parameters(), lr=1e-4) for p in pm.model_parts]

    def step(inputs, labels):
        pm.forward_backward(inputs, labels)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)

    return step, plan.local_batch(), pm.dp_rank, (pm, opts)


def _worker(payload: dict, rank: int, world: int) -> dict:
    import gc

    import torch
    import torch.distributed as dist

    from dtorch.models import model_config

    spec = payload["model"]
    vocab = model_config(spec).vocab_size
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    times: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    for rep in range(payload["reps"]):
        for name in payload["strategies"]:
            sides = ["dtorch", "hand"] if (rep + len(name)) % 2 == 0 else ["hand", "dtorch"]
            for side in sides:
                key = f"{name}/{side}"
                if key in errors:
                    continue
                try:
                    build = _build_dtorch if side == "dtorch" else _build_hand
                    step, local, dp_rank, keep = build(name, spec, device, world)
                    g = torch.Generator().manual_seed(1000 + dp_rank)
                    x = torch.randint(vocab, (local, SEQ + 1), generator=g)
                    inputs, labels = x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)
                    for _ in range(payload["warmup"]):
                        step(inputs, labels)
                    for _ in range(payload["steps"]):
                        dist.barrier()
                        t = time.perf_counter()
                        step(inputs, labels)
                        if device.type == "cuda":
                            torch.cuda.synchronize(device)
                        dist.barrier()
                        times.setdefault(key, []).append(time.perf_counter() - t)
                    del step, keep
                except Exception as e:  # noqa: BLE001 - reported per strategy
                    errors[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                gc.collect()
    return {"times": times, "errors": errors}


def run(quick: bool = False, world: int = 4, log=print) -> dict[str, Any]:
    # 8 repetitions: the per-step ratio spans +-15 % on this machine, and 5 left the median ratio
    # moving by +-5 % between runs (TP 1.040 then 0.972, ten minutes apart)
    reps, steps = (2, 2) if quick else (8, 3)
    log(f"overhead: {len(STRATEGIES)} strategies x (DTorch, hand-written) at world {world}, "
        f"{reps} interleaved repetitions x {steps} steps")
    t0 = time.perf_counter()
    out = run_group(world, _worker, {"model": MODEL, "strategies": list(STRATEGIES), "reps": reps,
                                     "steps": steps, "warmup": 1})
    r0 = out[0]
    if "times" not in r0:
        raise RuntimeError(f"overhead worker failed:\n{r0.get('error')}")
    rows = []
    for name in STRATEGIES:
        d, h = r0["times"].get(f"{name}/dtorch", []), r0["times"].get(f"{name}/hand", [])
        md, mh = stats.median(d), stats.median(h)
        # the spread of the ratio: pair the i-th DTorch rep with the i-th hand-written one
        per_rep = [a / b for a, b in zip(d, h)]
        rows.append({
            "strategy": name, "plan": STRATEGIES[name],
            "dtorch_step_s": md if d else None, "hand_step_s": mh if h else None,
            "ratio": md / mh if d and h else None,
            "ratio_min": min(per_rep) if per_rep else None, "ratio_max": max(per_rep) if per_rep else None,
            "dtorch_times_s": d, "hand_times_s": h,
            "error": r0["errors"].get(f"{name}/dtorch") or r0["errors"].get(f"{name}/hand"),
        })
    return {"config": {"model": MODEL, "seq_len": SEQ, "global_batch": GLOBAL_BATCH, "world_size": world,
                       "reps": reps, "steps_per_rep": steps, "quick": quick},
            "results": rows, "seconds": time.perf_counter() - t0}


def markdown(result: dict) -> str:
    c = result["config"]
    lines = ["## (b) Overhead: DTorch vs hand-written PyTorch", "",
             f"Model `{c['model']}`, seq {c['seq_len']}, global batch {c['global_batch']}, world {c['world_size']}, "
             f"{c['reps']} interleaved repetitions x {c['steps_per_rep']} steps, medians.", "",
             "| strategy | DTorch ms | hand-written ms | ratio | per-step ratio range | note |", "|---|---|---|---|---|---|"]
    for r in result["results"]:
        def ms(x):
            return "n/a" if x is None else f"{x * 1e3:.1f}"
        rng = "n/a" if r["ratio_min"] is None else f"{r['ratio_min']:.2f} - {r['ratio_max']:.2f}"
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"| {r['strategy']} | {ms(r['dtorch_step_s'])} | {ms(r['hand_step_s'])} | "
                     f"{ratio} | {rng} | {r['error'] or ''} |")
    return "\n".join(lines) + "\n"
