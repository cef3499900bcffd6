"""`OffloadedOptimizer`: a torch optimizer whose state and fp32 master weights live off the device.

It is a `torch.optim.Optimizer` over the model's own parameters (DTensors under FSDP/TP, plain
tensors under DDP or one rank), so LR schedulers, `zero_grad` and `dtorch.checkpoint` see what they
see with the in-memory optimizer: `state_dict()` has the same keys, shapes and placements. What
differs is where the numbers are and who computes:

  step():  for each block of parameters, in model order
      read its state from disk into a buffer (NVMe tier; the next block is read meanwhile)
      copy its gradients device -> host (non_blocking from pinned buffers on CUDA)
      run the optimizer spec's own CPU kernel on the fp32 masters and that state
      copy the updated masters host -> device, in the device parameter's dtype
      write its state back (NVMe tier, in the background)

Each block's CPU kernel is a torch optimizer built by the same spec (`spec.build`), so on a CPU
run the arithmetic is the in-memory optimizer's, bit for bit. With `overlap_backward` the same
loop runs on a worker thread during the backward, last block first, each block as soon as the
gradient hooks say its gradients are final.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtorch.errors import ConfigError
from dtorch.train.offload.config import OptimizerOffload, check_directory
from dtorch.train.offload.store import FLOAT, DiskBlocks, HostBlocks, Pipeline, host_empty, make_blocks

log = logging.getLogger("dtorch.train.offload")

_IMPL_FLAGS = ("params", "fused", "foreach", "capturable", "differentiable")
"""Keys of a param group that say how the kernel runs, not what it computes: never copied between
the public groups and the CPU kernels' groups."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def state_keys(spec: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(per-element state tensors, per-parameter scalars) of an optimizer spec, or ConfigError."""
    keys = getattr(spec, "state_keys", None)
    if keys is None:
        raise ConfigError("optimizer", type(spec).__name__,
                          "optimizer offload needs a spec that declares its state (dtorch.optim.AdamW or SGD)")
    return tuple(keys), tuple(getattr(spec, "scalar_keys", ()))


def bytes_needed(spec: Any, params: Iterable[torch.Tensor], cfg: OptimizerOffload) -> int:
    """Bytes of this rank's files in the NVMe tier (what `check_directory` must find room for)."""
    keys, _ = state_keys(spec)
    fields = len(keys) + (1 if cfg.params_on_disk else 0)
    return sum(_local(p).numel() for p in params if p.requires_grad) * FLOAT * fields


class OffloadedOptimizer(torch.optim.Optimizer):
    """`spec`'s optimizer over `params`, with its state in `cfg.tier` (see the module docstring)."""

    def __init__(self, params: Iterable[nn.Parameter], spec: Any, cfg: OptimizerOffload, *, tag: str = "r0"):
        params = [p for p in params]
        self.spec, self.cfg = spec, cfg
        self.keys, self.scalar_keys = state_keys(spec)
        self.device_params = [p for p in params if p.requires_grad]
        locals_ = [_local(p).detach() for p in self.device_params]
        self.accel = any(t.device.type != "cpu" for t in locals_)
        pin = self.accel and torch.cuda.is_available()
        on_disk = cfg.tier == "nvme"
        self.masters_on_disk = on_disk and cfg.params_on_disk
        fields = (("master",) if self.masters_on_disk else ()) + self.keys
        numels = [t.numel() for t in locals_]
        self.blocks = make_blocks(numels, fields, cfg.block_bytes)
        self._block_of = {i: (k, j) for k, b in enumerate(self.blocks) for j, i in enumerate(b.params)}
        # fp32 master weights: resident in host memory, unless the NVMe tier keeps them in its files
        self.masters: list[torch.Tensor | None] = [None] * len(locals_)
        if not self.masters_on_disk:
            for i, t in enumerate(locals_):
                m = host_empty(t.numel(), pin).view(t.shape)
                m.copy_(t)
                self.masters[i] = m
        if on_disk:
            check_directory(cfg.directory, bytes_needed(spec, self.device_params, cfg), cfg.budget_bytes)
            self.store = DiskBlocks(self.blocks, cfg.directory, tag)
        else:
            self.store = HostBlocks(self.blocks, pin)
        largest = max((b.numel for b in self.blocks), default=0)
        largest_grad = max((b.param_numel for b in self.blocks), default=0)
        # what a slot keeps resident between blocks: the largest block of at most block_bytes (the
        # pages an oversized parameter's block touched beyond it are handed back: `store.Slot`)
        regular = [b for b in self.blocks if b.numel * FLOAT <= cfg.block_bytes] or self.blocks
        keep = (max((b.numel for b in regular), default=0), max((b.param_numel for b in regular), default=0))
        self.io = Pipeline(self.store, cfg.buffers if on_disk else 2, largest, largest_grad, pin, keep)
        self.buffer_bytes = self.io.num_slots * ((largest if on_disk else 0) + largest_grad) * FLOAT
        # One CPU kernel per block, built by the spec over placeholders whose storage is swapped in
        # at each step (masters, the slot's gradient staging, the block's state).
        fused = cfg.fused if cfg.fused is not None else (True if self.accel else None)
        self._holders = [nn.Parameter(torch.empty(0), requires_grad=True) for _ in locals_]
        self.kernels = [self._build(spec, [self._holders[i] for i in b.params], fused) for b in self.blocks]
        self._scalars: list[dict[str, torch.Tensor] | None] = [None] * len(locals_)
        defaults = {k: v for k, v in self.kernels[0].defaults.items() if k not in _IMPL_FLAGS} if self.kernels else {}
        public = self._build(spec, [torch.empty(0, requires_grad=True)], None) if self.kernels else None
        if public is not None:  # the implementation flags the in-memory optimizer would report
            defaults.update({k: public.defaults[k] for k in _IMPL_FLAGS if k in public.defaults})
        super().__init__(self.device_params, defaults)
        self.init_bytes_written = 0
        if self.masters_on_disk:
            self._write_masters(locals_)
        self._streams = (torch.cuda.Stream(), torch.cuda.Stream()) if pin else None
        self.stats = {"steps": 0, "step_s": 0.0, "copy_s": 0.0, "kernel_s": 0.0, "in_backward": 0}
        """step_s: seconds in step() (with the overlap, what was left after the backward); copy_s and
        kernel_s: host seconds of the copies and of the CPU kernel (on CUDA the copies are only
        issued); in_backward: blocks stepped before step() was called."""
        self._overlap: _Overlap | None = None

    @staticmethod
    def _build(spec: Any, params: list[torch.Tensor], fused: bool | None) -> torch.optim.Optimizer:
        if fused is None:
            return spec.build(params)
        try:
            return spec.build(params, fused=fused)
        except TypeError:  # a spec without the switch: its own default kernel
            return spec.build(params)

    # ---- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):  # noqa: D401 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t0 = time.perf_counter()
        if self._overlap is not None and self._overlap.enabled:
            self._overlap.finish()  # the blocks the backward has not released yet: stepped now
        else:
            self._run_blocks(list(range(len(self.blocks))), None)
        if self._streams is not None:
            torch.cuda.current_stream().wait_stream(self._streams[1])  # the next forward sees new weights
        self.stats["steps"] += 1
        self.stats["step_s"] += time.perf_counter() - t0
        return loss

    def _run_blocks(self, order: list[int], ready: Any) -> None:
        """Step the blocks in `order`. `ready` (None: every gradient is final) is the overlap's
        `_Ready`: a block is stepped only once its gradients are final."""
        hyper = {k: v for k, v in self.param_groups[0].items() if k not in _IMPL_FLAGS}
        n = len(order)
        # slots: one stepped, one read ahead (and its gradients copied), one being written back
        ahead = max(1, self.io.num_slots - 2)
        pending = [self._begin(k, ready) for k in order[:ahead]]
        issued = len(pending)
        for k in order:
            slot, fut = pending.pop(0)
            if issued < n:
                pending.append(self._begin(order[issued], ready))
                issued += 1
            if ready is not None and not slot.grads_copied:
                ready.wait(k)
                self._grads_to_host(k, slot, ready.event(k))
            if fut is not None:
                fut.result()
            if slot.grad_event is not None:
                slot.grad_event.synchronize()
                slot.grad_event = None
            self._step_block(k, slot, hyper)
            self.io.finish(k, slot)
            if ready is not None:
                ready.done += 1
        self.io.drain()

    def _begin(self, k: int, ready: Any = None):
        """Block k into a free slot: its state read from disk (in the background) and, when they
        are final, its gradients copied to host (asynchronously on CUDA)."""
        slot, fut = self.io.start(k)
        slot.grads_copied = ready is None or ready.is_set(k)
        if slot.grads_copied:
            self._grads_to_host(k, slot, ready.event(k) if ready is not None else None)
        return slot, fut

    # ---- overlap with the backward ---------------------------------------------------------------
    def overlap_backward(self, microbatches: int = 1) -> None:
        """Step each block on a worker thread as soon as its gradients are final, while the
        backward of the earlier blocks runs: post-accumulate-grad hooks count each parameter's
        gradients (`microbatches` per step) and release its block when the last one lands.

        Only for runs whose gradients are final when they land: no clipping (the step would need
        the norm of them all), no DDP (its all-reduce lands later), no pipeline, no tensor
        parallelism (Partial gradients are reduced after the backward). The trainer asks
        `dtorch.plan.strategies.memory.step_overlaps_backward`, the planner's rule. Each block's arithmetic is the same kernel on the same numbers, so the
        losses stay bit-identical."""
        if self._overlap is None and self.blocks:
            self._overlap = _Overlap(self, int(microbatches))

    def _grads_to_host(self, k: int, slot, ready_event=None) -> None:
        """Copy block k's device gradients into the slot's staging (async on CUDA, after
        `ready_event`, recorded where the gradients were produced, else after the current stream)."""
        t = time.perf_counter()
        self._copy_grads(k, slot, ready_event)
        self.stats["copy_s"] += time.perf_counter() - t

    def _copy_grads(self, k: int, slot, ready_event) -> None:
        b = self.blocks[k]
        off = 0
        stream = self._streams[0] if self._streams is not None else None
        if stream is not None:
            if ready_event is not None:
                stream.wait_event(ready_event)
            else:
                stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if stream is not None else _nothing():
            for j, i in enumerate(b.params):
                g = self.device_params[i].grad
                n = b.numels[j]
                if g is not None:
                    slot.grad[off:off + n].view(self.masters_shape(i)).copy_(_local(g), non_blocking=stream is not None)
                off += n
        if stream is not None:
            ev = torch.cuda.Event()
            ev.record(stream)
            slot.grad_event = ev

    def masters_shape(self, i: int) -> torch.Size:
        return _local(self.device_params[i]).shape

    def _step_block(self, k: int, slot, hyper: dict[str, Any]) -> None:
        b = self.blocks[k]
        buf = self.store.buffer(k, slot)
        kernel = self.kernels[k]
        for g in kernel.param_groups:
            g.update(hyper)
        off = 0
        stepped = []
        for j, i in enumerate(b.params):
            holder, shape, n = self._holders[i], self.masters_shape(i), b.numels[j]
            holder.data = (buf[b.offsets[(j, "master")]:][:n].view(shape) if self.masters_on_disk
                           else self.masters[i])
            dev_grad = self.device_params[i].grad
            holder.grad = slot.grad[off:off + n].view(shape) if dev_grad is not None else None
            off += n
            if dev_grad is None:
                kernel.state.pop(holder, None)
                continue
            st = {key: buf[b.offsets[(j, key)]:][:n].view(shape) for key in self.keys}
            if self._scalars[i] is None:
                self._scalars[i] = {s: torch.tensor(0.0, dtype=_scalar_dtype()) for s in self.scalar_keys}
            st.update(self._scalars[i])
            kernel.state[holder] = st
            stepped.append(i)
        t = time.perf_counter()
        kernel.step()
        self.stats["kernel_s"] += time.perf_counter() - t
        for i in stepped:  # the kernel may have replaced scalars (e.g. a new step tensor)
            st = kernel.state[self._holders[i]]
            self._scalars[i] = {s: st[s] for s in self.scalar_keys if s in st}
            self.state[self.device_params[i]] = self._public_state(i, st)
        self._masters_to_device(k, slot)
        for i in b.params:  # no view of the slot outlives the step
            self._holders[i].grad = None
            kernel.state.pop(self._holders[i], None)

    def _public_state(self, i: int, st: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What `self.state[p]` shows: the scalars, and each state tensor where it lives (host
        tensors; on disk, a meta tensor of its shape: the keys are what torch's helpers read)."""
        out = dict(self._scalars[i])
        for key in self.keys:
            out[key] = st[key] if not self.store.on_disk else torch.empty(st[key].shape, device="meta")
        return out

    def _masters_to_device(self, k: int, slot) -> None:
        t = time.perf_counter()
        self._copy_masters(k, slot)
        self.stats["copy_s"] += time.perf_counter() - t

    def _copy_masters(self, k: int, slot) -> None:
        b = self.blocks[k]
        buf = self.store.buffer(k, slot)
        stream = self._streams[1] if self._streams is not None else None
        with torch.cuda.stream(stream) if stream is not None else _nothing():
            for j, i in enumerate(b.params):
                if self.device_params[i].grad is None and not self.masters_on_disk:
                    continue
                src = self._master(i, j, b, buf)
                _local(self.device_params[i]).copy_(src, non_blocking=stream is not None)
        if stream is not None:
            ev = torch.cuda.Event()
            ev.record(stream)
            slot.event = ev

    def _master(self, i: int, j: int, b, buf: torch.Tensor) -> torch.Tensor:
        if self.masters_on_disk:
            return buf[b.offsets[(j, "master")]:][: b.numels[j]].view(self.masters_shape(i))
        return self.masters[i]

    def _write_masters(self, locals_: list[torch.Tensor]) -> None:
        """The NVMe tier with params_on_disk: the initial fp32 masters go into the files."""
        for k, b in enumerate(self.blocks):
            slot, _ = self.io.start(k, read=False)  # the whole block is written: nothing to read
            buf = self.store.buffer(k, slot)
            buf.zero_()
            for j, i in enumerate(b.params):
                buf[b.offsets[(j, "master")]:][: b.numels[j]].view(locals_[i].shape).copy_(locals_[i])
            self.io.finish(k, slot)
        self.io.drain()
        self.init_bytes_written = getattr(self.store, "bytes_written", 0)

    @torch.no_grad()
    def sync_masters_from_model(self) -> None:
        """The fp32 masters := the model's parameters (after a checkpoint or weights were loaded
        into the model; its parameters are fp32, so nothing is lost)."""
        for k, b in enumerate(self.blocks):
            with self.store.mapped(k) if self.masters_on_disk else _nothing() as flat:
                for j, i in enumerate(b.params):
                    src = _local(self.device_params[i]).detach()
                    if self.masters_on_disk:
                        flat[b.offsets[(j, "master")]:][: b.numels[j]].view(src.shape).copy_(src)
                    else:
                        self.masters[i].copy_(src)

    # ---- state dict: the in-memory optimizer's shape ---------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        self.io.drain()
        ids = {p: n for n, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state: dict[int, dict[str, Any]] = {}
        for k, b in enumerate(self.blocks):
            with self.store.mapped(k) as flat:
                for j, i in enumerate(b.params):
                    if self._scalars[i] is None:
                        continue  # never stepped: no state, as in torch
                    p = self.device_params[i]
                    entry: dict[str, Any] = {s: v for s, v in self._scalars[i].items()}
                    for key in self.keys:
                        local = flat[b.offsets[(j, key)]:][: b.numels[j]].view(self.masters_shape(i))
                        entry[key] = _like(p, local)
                    state[ids[p]] = entry
        groups = []
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [ids[p] for p in g["params"]]})
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.io.drain()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        ordered = [p for g in self.param_groups for p in g["params"]]
        for g, saved in zip(self.param_groups, groups):
            if len(g["params"]) != len(saved["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                                 "optimizer's group")
            g.update({k: v for k, v in saved.items() if k != "params"})
        # saved ids are positions or names (torch's helpers pass fully qualified names): matched
        # through the groups' params lists, as torch.optim.Optimizer.load_state_dict does
        id_map = dict(zip((pid for g in groups for pid in g["params"]), ordered))
        by_param = {id_map[pid]: st for pid, st in state_dict["state"].items() if pid in id_map}
        for k, b in enumerate(self.blocks):
            with self.store.mapped(k) as flat:
                for j, i in enumerate(b.params):
                    st = by_param.get(self.device_params[i])
                    if st is None:
                        self._scalars[i] = None
                        self.state.pop(self.device_params[i], None)
                        continue
                    shape = self.masters_shape(i)
                    views = {}
                    for key in self.keys:
                        dst = flat[b.offsets[(j, key)]:][: b.numels[j]].view(shape)
                        src = _local(st[key]) if isinstance(st[key], torch.Tensor) else torch.as_tensor(st[key])
                        if src.data_ptr() != dst.data_ptr():
                            dst.copy_(src)
                        views[key] = dst
                    self._scalars[i] = {s: (st[s].detach().clone().float().cpu() if isinstance(st[s], torch.Tensor)
                                            else torch.tensor(float(st[s]), dtype=_scalar_dtype()))
                                        for s in self.scalar_keys if s in st}
                    self.state[self.device_params[i]] = self._public_state(i, views)
        self.sync_masters_from_model()  # the model was loaded first (checkpoint order: model, optim)

    # ---- figures ---------------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Bytes this optimizer holds per place: host (masters + resident state + buffers), disk."""
        masters = sum(m.numel() for m in self.masters if m is not None) * FLOAT
        resident = 0 if self.store.on_disk else self.store.nbytes
        return {"host_bytes": masters + resident + self.buffer_bytes, "buffer_bytes": self.buffer_bytes,
                "disk_bytes": self.store.nbytes if self.store.on_disk else 0}

    def io_stats(self) -> dict[str, float]:
        s = self.store
        return {"bytes_read": getattr(s, "bytes_read", 0), "bytes_written": getattr(s, "bytes_written", 0),
                "init_bytes_written": self.init_bytes_written,
                "read_s": getattr(s, "read_s", 0.0), "write_s": getattr(s, "write_s", 0.0),
                "mode": getattr(s, "mode", None),
                "step_s": self.stats["step_s"], "steps": self.stats["steps"]}

    def close(self) -> None:
        """Stop the I/O threads and remove the NVMe tier's files (also done at exit)."""
        if self._overlap is not None:
            self._overlap.close()
        self.io.close()
        self.store.close()


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` in `p`'s layout: a DTensor with p's mesh and placements (without moving it to p's
    device), or the tensor itself."""
    if not isinstance(p, DTensor):
        return local
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(p._spec.mesh, p._spec.placements, TensorMeta(p.shape, p.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class _Ready:
    """Which blocks' gradients are final in the current step (set from the autograd hooks)."""

    def __init__(self, num_blocks: int, cuda: bool):
        self.flags = [threading.Event() for _ in range(num_blocks)]
        self.events: list[Any] = [None] * num_blocks
        self.cuda = cuda
        self.done = 0  # blocks stepped
        self.aborted = False

    def set(self, k: int) -> None:
        if self.cuda:  # the gradients were produced on the stream current in the hook
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream())
            self.events[k] = ev
        self.flags[k].set()

    def set_all(self) -> None:
        for k, f in enumerate(self.flags):
            if not f.is_set():
                self.set(k)

    def is_set(self, k: int) -> bool:
        return self.flags[k].is_set()

    def wait(self, k: int) -> None:
        self.flags[k].wait()
        if self.aborted:
            raise RuntimeError("the offloaded optimizer's step was abandoned (the optimizer closed mid-backward)")

    def abort(self) -> None:
        self.aborted = True
        for f in self.flags:
            f.set()

    def event(self, k: int):
        return self.events[k]


class _Overlap:
    """The optimizer step run on a worker thread during the backward (`overlap_backward`). Blocks
    are stepped last first, the order in which the backward finishes them; step() releases the
    blocks whose gradients never came (unused parameters) and waits for the worker."""

    def __init__(self, opt: OffloadedOptimizer, microbatches: int):
        from concurrent.futures import ThreadPoolExecutor

        self.opt, self.microbatches = opt, microbatches
        self.order = list(range(len(opt.blocks)))[::-1]
        self.index = {p: i for i, p in enumerate(opt.device_params)}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="dtorch-offload-step")
        self.lock = threading.Lock()
        self.handles = [p.register_post_accumulate_grad_hook(self._landed) for p in opt.device_params]
        self.enabled = True
        """False: the hooks do nothing and step() steps after the backward (switch between steps only;
        the benchmark alternates it to compare the two under the same load)."""
        self._reset()

    def _reset(self) -> None:
        self.counts = [0] * len(self.opt.device_params)
        self.left = [len(b.params) for b in self.opt.blocks]
        self.ready = _Ready(len(self.opt.blocks), self.opt._streams is not None)
        self.future = None

    def _landed(self, p: torch.Tensor) -> None:
        if not self.enabled:
            return
        i = self.index[p]
        with self.lock:
            self.counts[i] += 1
            if self.counts[i] != self.microbatches:
                return
            k = self.opt._block_of[i][0]
            self.left[k] -= 1
            if self.left[k]:
                return
            self.ready.set(k)
            if self.future is None:
                self.future = self.pool.submit(self._work, self.ready)

    def _work(self, ready: _Ready) -> None:
        with torch.no_grad():
            self.opt._run_blocks(self.order, ready)

    def finish(self) -> None:
        """The backward is over: release every block and wait for the worker (its error, if any,
        is raised here); without a worker (no gradient landed) the blocks are stepped here."""
        with self.lock:
            ready, fut = self.ready, self.future
            self.opt.stats["in_backward"] += ready.done
            ready.set_all()
        try:
            if fut is None:
                self.opt._run_blocks(self.order, ready)
            else:
                fut.result()
        finally:
            self._reset()

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.ready.abort()
        self.pool.shutdown(wait=True)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def build(spec: Any, params: Iterable[nn.Parameter], cfg: OptimizerOffload | None, *, tag: str = "r0"):
    """The optimizer of one model part: the spec's own (in device memory) or an offloaded one."""
    if cfg is None:
        return spec.build(params)
    return OffloadedOptimizer(params, spec, cfg, tag=tag or f"p{os.getpid()}")
