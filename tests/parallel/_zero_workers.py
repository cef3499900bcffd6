"""The workers of tests/parallel/test_zero.py, in a module the forkserver's processes import by name."""

from __future__ import annotations

import _training

from dtorch.plan.plan import Plan


def _count(kwargs: dict, rank: int) -> dict:
    """All-gathers and reduce-scatters of this rank's second training step (the first builds
    AdamW's state and, under PP, the stages' shapes), and its FSDP units."""
    import contextlib

    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.utils._python_dispatch import TorchDispatchMode

    from dtorch.parallel import parallelize
    from dtorch.train.losses import next_token

    class Count(TorchDispatchMode):  # the collectives torch dispatches (c10d ops), by name
        def __init__(self):
            super().__init__()
            self.n: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                self.n[str(func)] = self.n.get(str(func), 0) + 1
            return func(*args, **(kwargs or {}))

    plan = Plan(**kwargs)
    pm = parallelize(_training.factory, plan, loss_fn=next_token, seed=0, seq_len=_training.SEQ)
    opt = torch.optim.AdamW(list(pm.parameters()), lr=_training.LR)
    counts: dict = {}
    for step in range(2):
        x, y = _training.batch(step, plan.dp * plan.local_batch())
        rows = slice(pm.dp_rank * pm.local_batch, (pm.dp_rank + 1) * pm.local_batch)
        mode = Count()
        with mode if step == 1 else contextlib.nullcontext():
            pm.forward_backward(x[rows], y[rows])
            opt.step()
            opt.zero_grad()
        if step == 1:
            counts = mode.n
    units = sum(isinstance(m, FSDPModule) for part in pm.model_parts for m in part.modules())
    return {"counts": counts, "units": units}


def worker(case: tuple[str, str, dict], rank: int) -> dict:
    kind, _, kwargs = case
    return _training.parallel(kwargs, rank) if kind == "loss" else _count(kwargs, rank)
