"""The cost model's operator and collective counts (`dtorch.plan.cost.step_counts`) against what the
executor really dispatches: one training step per plan on 2 gloo ranks, counted with a
TorchDispatchMode. When the executor or torch changes what a step dispatches, this fails and the
constants in `CostConstants` need a new count."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _harness import run_group  # noqa: E402

MODEL = "llama-tiny:hidden=64,heads=4,kv_heads=2,layers=2,seq=32"
SEQ = 32
PLANS = [
    {"dp_replicate": 2, "microbatch_size": 2, "num_microbatches": 2},
    {"dp_shard": 2, "microbatch_size": 2, "num_microbatches": 2, "reshard_after_forward": False},
    {"tp": 2, "sp": True, "microbatch_size": 4, "num_microbatches": 1},
    {"tp": 2, "sp": True, "microbatch_size": 2, "num_microbatches": 2, "ac": "full"},
    {"tp": 2, "sp": True, "microbatch_size": 2, "num_microbatches": 2, "ac": "selective"},
]


def _count(case: dict, rank: int) -> dict:
    import contextlib
    from collections import Counter

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from dtorch.models import build_model, model_config
    from dtorch.parallel.parallelize import parallelize
    from dtorch.plan.plan import Plan
    from dtorch.train.losses import next_token

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n[func.namespace] += 1
            return func(*args, **(kwargs or {}))

    plan = Plan(seq_len=SEQ, param_dtype="float32", **case)
    pm = parallelize(lambda: build_model(MODEL), plan, loss_fn=next_token, device="cpu", seed=0, seq_len=SEQ)
    opts = [torch.optim.AdamW(p.parameters(), lr=1e-4) for p in pm.model_parts]
    x = torch.randint(model_config(MODEL).vocab_size, (plan.local_batch(), SEQ + 1),
                      generator=torch.Generator().manual_seed(1))
    counts: dict = {}
    for j in range(2):  # the first step creates optimizer states: count the second
        mode = Count()
        with mode if j == 1 else contextlib.nullcontext():
            pm.forward_backward(x[:, :-1].contiguous(), x[:, 1:].contiguous())
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)
        counts = dict(mode.n)
    return counts


@pytest.mark.slow
def test_cost_model_counts_what_a_step_dispatches():
    from dtorch.model import profile_module
    from dtorch.models import build_model
    from dtorch.plan.cost import recompute_reruns_collectives, step_counts
    from dtorch.plan.plan import Plan

    results = run_group(2, PLANS, _count)
    prof = profile_module(lambda: build_model(MODEL), SEQ)
    for case, per_rank in zip(PLANS, results):
        assert all("error" not in r for r in per_rank), per_rank
        plan = Plan(seq_len=SEQ, **case)
        n = step_counts(plan, prof, "cpu")
        m = plan.num_microbatches
        aten = max(r.get("aten", 0) for r in per_rank)
        predicted_ops = m * n.ops_per_microbatch + n.optimizer_ops
        print(f"{plan.describe()}: aten ops {aten} (model {predicted_ops:.0f})", end="")
        assert aten == pytest.approx(predicted_ops, rel=0.25), (case, aten, predicted_ops)
        if plan.tp > 1:
            c10d = max(r.get("c10d", 0) + r.get("_c10d_functional", 0) for r in per_rank)
            act = 8 + (4 if recompute_reruns_collectives(plan.ac) else 0)
            predicted = m * (prof.num_layers * act + n.tp_small_per_microbatch) + n.tp_small_per_step
            print(f", collectives {c10d} (model {predicted:.0f})", end="")
            assert c10d == pytest.approx(predicted, rel=0.25), (case, c10d, predicted)
        print()
