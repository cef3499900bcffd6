"""The worker of tests/plan/test_memory_categories.py: one steady-state step of a plan under torch's
MemTracker, the rank's peak by category (see that test for the categories). Here, in tests/parallel,
so that the harness's forkserver (which has this folder on its path) can import it."""

from __future__ import annotations

from functools import partial

import torch

SEQ = 64
CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")


class _Autocast:
    """Whether a `torch.autocast` context is open (the executor computes in param_dtype by autocast
    where no FSDP casts the parameters, `ParallelModel._compute_context`). Inside the dispatch,
    `torch.is_autocast_enabled` reads False (autocast excludes itself before it casts), so the
    contexts are counted as they are entered and left."""

    def __init__(self):
        self.open = 0
        self._enter, self._exit = torch.autocast.__enter__, torch.autocast.__exit__
        counted = self

        def enter(ctx):
            counted.open += 1
            return counted._enter(ctx)

        def leave(ctx, *exc):
            counted.open -= 1
            return counted._exit(ctx, *exc)

        torch.autocast.__enter__, torch.autocast.__exit__ = enter, leave

    def restore(self) -> None:
        torch.autocast.__enter__, torch.autocast.__exit__ = self._enter, self._exit


def _tracker(autocast: _Autocast | None = None, settled: _Settled | None = None):
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

    class _StepTracker(MemTracker):
        """MemTracker that lets a root module run forward more than once in the tracked region
        (pipeline micro-batches): its module statistics start afresh; the storages' categories,
        which are what is compared, are kept.

        Autocast's copies of the parameters in the compute dtype (`aten._to_copy` of a parameter's
        storage while an autocast context is open: its cast cache keeps one per weight until the
        context ends) are parameters (PARAM), as FSDP2's gathered copies in param_dtype are;
        MemTracker, which meets them as the output of an op in the forward, would call them
        activations."""

        _param_cast = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self._param_cast = bool(autocast is not None and autocast.open and func is torch.ops.aten._to_copy.default
                                    and args and isinstance(args[0], torch.Tensor) and self._is_param(args[0]))
            held = settled.before(func, args) if settled is not None else None
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._param_cast = False
            if settled is not None:
                settled.after(func, held, args, out)
            return out

        def _is_param(self, t) -> bool:
            from torch.distributed._tools.mem_tracker import get_untyped_storages

            return any(self._WINFO.get(st, (None, None))[0] is not None
                       and self._WINFO[st][0].reftype == _MemRefType.PARAM for st in get_untyped_storages(t))

        def _track(self, reftype, t):
            super()._track(_MemRefType.PARAM if self._param_cast else reftype, t)

        def _update_peak_stats(self, peak_state):
            # only the rank's peak is read (`get_tracker_snapshot("peak")`): MemTracker's own also
            # walks every module's statistics after every operator, most of the tracked step's time
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

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


class _Settled:
    """Collectives that return only once gloo's worker thread has let go of their tensors. The
    thread wakes the caller when a collective completes and drops its reference to the work (which
    holds the input and output) a moment later, so a tensor the step has finished with can outlive
    the call for as long as the machine takes to schedule that thread: on busy cores MemTracker
    then counted the routed experts' all-to-all buffers (R x h each) at the peak, or moved the peak
    to another moment, from one run to the next. Each synchronous collective, and each work's
    `wait`, here waits (at most `TIMEOUT` s) until the tensors passed to it are referenced no more
    than before the call; the step's own tensors and what it keeps are unchanged. The functional
    collectives (`_c10d_functional`, DTensor's redistributions: tensor and sequence parallelism, the
    routed experts under TP), which the tracker meets in its dispatch (`before`/`after`), settle the
    same way at their `wait_tensor`. Their output, which the step holds on to, cannot be settled by
    its references (how many the work adds is not known); `wait_tensor` also waits until no other
    thread of the process (gloo's workers, the only others in a rank of these tests) is running or
    runnable: a worker drops its work before it sleeps again, so a freed output is then freed at
    once, not on gloo's thread during a later operator."""

    NAMES = ("all_to_all_single", "all_gather_single", "reduce_scatter_single", "all_reduce",
             "all_gather_into_tensor", "reduce_scatter_tensor")
    TIMEOUT = 1.0
    """Never reached on a quiet machine (the thread lets go within microseconds); under load the
    thread may wait for a core that long."""

    def __init__(self):
        import torch.distributed as dist

        self._dist, self._saved, self._works, self._outputs = dist, {}, {}, {}
        self._others = _other_threads()
        self._wait = dist.Work.wait
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(fn))
        settled = self

        def wait(work, *args, **kwargs):
            out = settled._wait(work, *args, **kwargs)
            settled._settle(settled._works.pop(id(work), ()))
            return out

        dist.Work.wait = wait

    def _wrap(self, fn):
        import weakref

        def call(*args, **kwargs):
            held = [(weakref.ref(t), t._use_count()) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            work = fn(*args, **kwargs)
            if kwargs.get("async_op") and work is not None:
                self._works[id(work)] = held
            else:
                self._settle(held)
            return work

        return call

    def _settle(self, held) -> None:
        import time

        deadline = time.monotonic() + self.TIMEOUT
        while time.monotonic() < deadline:
            if all(t is None or t._use_count() <= n for t, n in ((r(), n) for r, n in held)):
                return
            time.sleep(0)

    def before(self, func, args) -> list | None:
        """The references a functional collective's tensors have before the call (None: not one)."""
        import weakref

        if getattr(func, "namespace", None) != "_c10d_functional" or func.__name__.startswith("wait_tensor"):
            return None
        return [(weakref.ref(t), t._use_count()) for t in _tensors(args)]

    def after(self, func, held: list | None, args, out) -> None:
        """A functional collective's outputs wait for their `wait_tensor`, which settles its inputs."""
        if held is not None:
            for t in _tensors([out]):
                self._outputs[t.data_ptr()] = held
        elif getattr(func, "namespace", None) == "_c10d_functional":
            for t in _tensors(args):
                self._settle(self._outputs.pop(t.data_ptr(), ()))
            self._idle()

    def _idle(self) -> None:
        """Wait (at most `TIMEOUT` s) until none of the other threads is running or runnable."""
        import time

        deadline = time.monotonic() + self.TIMEOUT
        while time.monotonic() < deadline and any(_running(tid) for tid in self._others):
            time.sleep(0)

    def restore(self) -> None:
        for name, fn in self._saved.items():
            setattr(self._dist, name, fn)
        self._dist.Work.wait = self._wait


def _other_threads() -> list[int]:
    """The native ids of this process's threads other than the caller's."""
    import os
    import threading

    me = threading.get_native_id()
    return [int(t) for t in os.listdir("/proc/self/task") if int(t) != me]


def _running(tid: int) -> bool:
    """Whether thread `tid` of this process is running or runnable (state R in its /proc stat)."""
    try:
        with open(f"/proc/self/task/{tid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] == b"R"
    except (OSError, IndexError):
        return False  # (gone)


def _tensors(values) -> list[torch.Tensor]:
    """The tensors in `values`, one level of lists or tuples deep (a coalesced collective's)."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(t for t in v if isinstance(t, torch.Tensor))
    return out


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
    # the first step builds the pipeline schedule and the optimizer states, and the second is steady;
    # DDP rebuilds its buckets in the second (in call order: an allocation of every gradient's size
    # that no later step makes), so it is tracked in the third. The tracked step takes the third
    # batch drawn either way (the MoE figures depend on its routing, and on the router's bias,
    # which sees one load-balancing update fewer without DDP)
    batches = [torch.randint(0, 256, (plan.dp * local, SEQ + 1), generator=g) for _ in range(3)]
    return steady_peak(pm, opt, buckets, [(x[rows, :-1], x[rows, 1:]) for x in batches])


def steady_peak(pm, opt, buckets: _BucketRecorder, batches: list) -> dict:
    """Train `pm` on the last steps of `batches` ((input, target) of this rank, three of them) and
    return the tracked step's peak by category: the third step under DDP (its buckets rebuilt in the
    second), else the second; the tracked step takes the third batch either way."""
    from torch.nn.parallel import DistributedDataParallel

    last = 2 if any(isinstance(part, DistributedDataParallel) for part in pm.model_parts) else 1
    for step in range(last + 1):
        x, y = batches[len(batches) - 1 - last + step]
        autocast = _Autocast() if step == last else None
        settled = _Settled() if step == last else None
        tracker = _tracker(autocast, settled) if step == last else None
        if tracker is not None:
            tracker.track_external(*pm.model_parts, opt)
            buckets.register(tracker)  # (the second step's: the rebuilt buckets every later step uses)
            tracker.__enter__()
        buckets.buckets.clear()
        try:
            pm.forward_backward(x, y)
            opt.step()
            opt.zero_grad()
        finally:
            if tracker is not None:
                tracker.__exit__(None, None, None)
                settled.restore()
                autocast.restore()
    return peak_by_category(tracker)


def peak_by_category(tracker) -> dict:
    """The tracker's peak snapshot (its first device) as bytes per category, and their sum."""
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    out = dict.fromkeys(CATEGORIES, 0)
    for kind, nbytes in peak.items():
        name = _NAMES.get(getattr(kind, "value", kind))
        if name:
            out[name] = out.get(name, 0) + nbytes
    out["peak"] = sum(out[c] for c in CATEGORIES) + out.get("other", 0)
    return out


def memory_table(groups, measure_fn, predict) -> dict:
    """Run every group's cases (`groups`: (world, {family: (spec, fields)}) pairs, one process group
    each) and return {family: (world, predicted, measured on the fullest rank)}, printing the
    figures per category; a case that failed has None predicted and its traceback measured."""
    from _harness import run_group

    out = {}
    for world, cases in groups:
        results = run_group(world, list(cases.values()), measure_fn)
        for (name, (spec, fields)), per_rank in zip(cases.items(), results):
            errors = [r["error"] for r in per_rank if "error" in r]
            if errors:
                out[name] = (world, None, errors[0])
                continue
            out[name] = (world, predict(spec, fields, world), max(per_rank, key=lambda r: r["peak"]))
    lines = [f"{'family':26s} {'category':11s} {'predicted':>10s} {'measured':>10s}  error"]
    for name, (world, pred, meas) in out.items():
        if pred is None:
            lines.append(f"{name + f' w{world}':26s} did not run: {meas.strip().splitlines()[-1]}")
            continue
        for c in (*CATEGORIES, "peak"):
            err = (pred[c] - meas[c]) / meas[c] if meas[c] else float(pred[c] != 0)
            lines.append(f"{name + f' w{world}':26s} {c:11s} {pred[c]:10d} {meas[c]:10d}  {err:+.1%}")
    print("\n".join(lines))
    return out
