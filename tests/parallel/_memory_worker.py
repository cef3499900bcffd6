"""The worker of tests/plan/test_memory_categories.py: one steady-state step of a plan under torch's
MemTracker, the rank's peak by category (see that test for the categories). Here, in tests/parallel,
so that the harness's forkserver (which has this folder on its path) can import it."""

from __future__ import annotations

from functools import partial

import torch

SEQ = 64
CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")


def _tracker():
    from torch.distributed._tools.mem_tracker import MemTracker

    class _StepTracker(MemTracker):
        """MemTracker that lets a root module run forward more than once in the tracked region
        (pipeline micro-batches): its module statistics start afresh; the storages' categories,
        which are what is compared, are kept."""

        def _pre_fw_hook(self, module, inputs):
            name = self._mod_tracker.get_known_fqn(module)
            if (module in self.memory_tracking and not self._mod_tracker.is_bw
                    and set(self._mod_tracker.parents) - {name} <= {"Global"}):
                del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

        def _post_fw_hook(self, module, inputs, outputs):
            # FSDP2 gathers a unit in the unit's own pre-forward hook, after MemTracker's (global
            # hooks run first), so the parameters MemTracker meets there are the shards. A unit's
            # submodules meet the gathered copies in theirs; a unit that holds its parameters itself
            # (the routed experts' GroupedExperts) would leave them to the op that fills them, and
            # they would count as an activation. Its post-forward hook runs before FSDP's reshard:
            # its parameters are the gathered copies there.
            if not self._mod_tracker.is_bw:
                from torch.distributed._tools.mem_tracker import _MemRefType

                for p in module.parameters(recurse=False):
                    self._update_and_maybe_create_winfos(p, _MemRefType.PARAM)
            super()._post_fw_hook(module, inputs, outputs)

    return _StepTracker()


_NAMES = {"Parameter": "params", "Gradient": "grads", "Optstate": "optimizer", "Activation": "activations",
          "Temp": "activations", "Buffer": "buffers", "Other": "other"}


class _BucketRecorder:
    """Records the gradient buckets DistributedDataParallel hands its communication hook (DTorch's
    `reduce_in_dtype`) in the latest step. The reducer allocates them once, when it (re)builds its
    buckets, outside the tracked step; MemTracker first meets a bucket's storage when the reducer
    copies a gradient into it during the backward and would call it a temporary (an activation).
    They are registered as buffers before the tracked step instead, each storage once."""

    def __init__(self):
        import dtorch.parallel.fsdp as fsdp

        self.buckets: dict[int, torch.Tensor] = {}
        self._hook = fsdp.reduce_in_dtype

        def recording(state, bucket):
            buf = bucket.buffer()
            self.buckets[bucket.index()] = buf
            return self._hook(state, bucket)

        fsdp.reduce_in_dtype = recording  # (wrap_ddp looks the hook up when it registers it)

    def restore(self) -> None:
        import dtorch.parallel.fsdp as fsdp

        fsdp.reduce_in_dtype = self._hook

    def register(self, tracker) -> None:
        from torch.distributed._tools.mem_tracker import _MemRefType

        for buf in self.buckets.values():
            tracker._update_and_maybe_create_winfos(buf, _MemRefType.BUFFER)


def measure(case, rank):
    """One steady-state step of `case` on this rank: the peak's bytes by category."""
    from dtorch.models import build_model
    from dtorch.parallel import parallelize
    from dtorch.plan.plan import Plan
    from dtorch.train.losses import next_token

    torch.set_num_threads(1)
    spec, fields = case
    plan = Plan(**fields)
    buckets = _BucketRecorder()
    try:
        pm = parallelize(partial(build_model, spec), plan, loss_fn=next_token, seed=0, seq_len=SEQ)
    finally:
        buckets.restore()
    opt = torch.optim.AdamW(list(pm.parameters()), lr=1e-3, foreach=False)
    g = torch.Generator().manual_seed(0)
    local = pm.local_batch
    rows = slice(pm.dp_rank * local, (pm.dp_rank + 1) * local)
    # the first step builds the pipeline schedule and the optimizer states; DDP rebuilds its buckets
    # in the second (in call order: an allocation of every gradient's size that no later step makes)
    for step in range(3):
        x = torch.randint(0, 256, (plan.dp * local, SEQ + 1), generator=g)
        tracker = _tracker() if step == 2 else None
        if tracker is not None:
            tracker.track_external(*pm.model_parts, opt)
            buckets.register(tracker)  # (the second step's: the rebuilt buckets every later step uses)
            tracker.__enter__()
        buckets.buckets.clear()
        try:
            pm.forward_backward(x[rows, :-1], x[rows, 1:])
            opt.step()
            opt.zero_grad()
        finally:
            if tracker is not None:
                tracker.__exit__(None, None, None)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    out = dict.fromkeys(CATEGORIES, 0)
    for kind, nbytes in peak.items():
        name = _NAMES.get(getattr(kind, "value", kind))
        if name:
            out[name] = out.get(name, 0) + nbytes
    out["peak"] = sum(out[c] for c in CATEGORIES) + out.get("other", 0)
    return out
