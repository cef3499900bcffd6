"""Does a plan's precision reach the kernels? One run, float32 and bfloat16 plans side by side.

For every strategy (single device; DDP, FSDP, TP+SP, CP at world 2 on PyTorch's fake process group)
apply a plan with param_dtype = reduce_dtype = float32
and one with bfloat16, run one forward and backward of the tiny Llama, and record the dtypes of
every matrix multiplication and of every gradient collective issued during backward.

    .venv/bin/python benchmarks/precision_applied.py   # -> benchmarks/results/precision_applied.{json,md}
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from dtorch.models import build_model
from dtorch.parallel import parallelize
from dtorch.plan.plan import Plan
from dtorch.train.losses import next_token

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
STRATEGIES = {
    "single": {}, "ddp": dict(dp_replicate=2), "fsdp": dict(dp_shard=2), "tp_sp": dict(tp=2, sp=True),
    "cp": dict(cp=2),
}


class Matmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.dtypes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            key = str(args[-1].dtype).removeprefix("torch.")
            self.dtypes[key] = self.dtypes.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


def one(strategy: dict, dtype: str) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    plan = Plan(**strategy, microbatch_size=4, param_dtype=dtype, reduce_dtype=dtype)
    if plan.world_size > 1:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    reductions: dict[str, int] = {}
    originals = {n: getattr(dist, n) for n in ("all_reduce", "reduce_scatter_single") if hasattr(dist, n)}

    def wrap(name):
        def run(*args, **kwargs):
            if torch._C._current_graph_task_id() != -1:
                t = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
                key = str(t.dtype).removeprefix("torch.")
                reductions[key] = reductions.get(key, 0) + 1
            return originals[name](*args, **kwargs)
        return run

    try:
        pm = parallelize(partial(build_model, "llama-tiny", heads=8, kv_heads=4), plan, loss_fn=next_token,
                         seq_len=64)
        x = torch.randint(0, 256, (4, 64))
        for n in originals:
            setattr(dist, n, wrap(n))
        mode = Matmuls()
        with mode:
            pm.forward_backward(x, x)
        for n, f in originals.items():
            setattr(dist, n, f)
        return {"matmul_dtypes": mode.dtypes, "gradient_reduction_dtypes": reductions}
    finally:
        for n, f in originals.items():
            setattr(dist, n, f)
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    results = {name: {dt: one(s, dt) for dt in ("float32", "bfloat16")} for name, s in STRATEGIES.items()}
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "precision_applied.json").write_text(json.dumps(results, indent=2))
    lines = ["# Precision applied: float32 vs bfloat16 plans, one run", "",
             "`.venv/bin/python benchmarks/precision_applied.py` (tiny Llama, batch 4 x 64; world 2 on the fake "
             "process group). Counts of matmuls and of gradient collectives during backward, by dtype. "
             "TP+SP reduces no gradient in backward (its norm gradients are reduced after it, in float32).",
             "", "| strategy | plan dtype | matmuls | gradient reductions | single-device step (s) |",
             "|---|---|---|---|---|"]
    for name, by in results.items():
        for dt, r in by.items():
            lines.append(f"| {name} | {dt} | {r['matmul_dtypes']} | {r['gradient_reduction_dtypes'] or '-'} |")
    (out / "precision_applied.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
