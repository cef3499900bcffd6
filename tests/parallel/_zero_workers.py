"""The worker of tests/parallel/test_zero.py, in a module the forkserver's processes import by name."""

from __future__ import annotations

from functools import partial

import _training

from dtorch.plan.plan import Plan


def worker(case: tuple[str, dict], rank: int) -> dict:
    """`_training.parallel`'s loop (AdamW in float32, 3 steps unless `steps` says, on the batches of
    the one-process reference), counting the collectives torch dispatches (c10d operators, by name)
    in the second step (the first builds AdamW's state and, under PP, the stages' shapes). Returns
    the losses, the checkpoint keys, the counts and this rank's FSDP units that hold parameters."""
    import contextlib

    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.utils._python_dispatch import TorchDispatchMode

    from dtorch.parallel import parallelize
    from dtorch.train.losses import next_token

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                self.n[str(func)] = self.n.get(str(func), 0) + 1
            return func(*args, **(kwargs or {}))

    kwargs = dict(case[1])
    model_name = kwargs.pop("model", "llama-tiny")
    steps = kwargs.pop("steps", 3)
    plan = Plan(**kwargs)
    pm = parallelize(partial(_training.factory, model_name), plan, loss_fn=next_token, seed=0, seq_len=_training.SEQ)
    opt = torch.optim.AdamW(list(pm.parameters()), lr=_training.LR, foreach=False)
    rows = slice(pm.dp_rank * pm.local_batch, (pm.dp_rank + 1) * pm.local_batch)
    losses, counts = [], {}
    for step in range(steps):
        x, y = _training.batch(step, plan.dp * plan.local_batch())
        mode = Count()
        with mode if step == 1 else contextlib.nullcontext():
            loss = pm.forward_backward(x[rows], y[rows])
            pm.clip_grad_norm_(1e9)
            opt.step()
            opt.zero_grad()
        losses.append(float(loss))
        if step == 1:
            counts = mode.n
    # (a unit with parameters of its own: a middle stage's root holds none and issues no collective)
    units = sum(isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None
                for part in pm.model_parts for m in part.modules())
    return {"losses": losses, "keys": sorted(pm.state_dict_for_checkpoint()), "counts": counts, "units": units}
