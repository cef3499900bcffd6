"""Exposed communication time per mesh axis, measured without synchronising anything.

What a rank *waits* for is what costs it: the time its Python thread spends inside a blocking
collective, launching an asynchronous one, or inside `Work.wait()` / `wait_tensor()` of it.
`CommTimer` wraps those entry points of `torch.distributed` (the c10d collectives, `Work.wait`,
and the functional collectives DTensor uses, launch and wait) with a `perf_counter` pair and adds the seconds to the mesh axis of the
process group the collective ran on. Nothing is launched, nothing is synchronised.

With tracing on (`trace_to(path)`, the trainer's ``--trace-comms``), every collective this rank
launches is also appended to a per-rank file *before* it runs (op, axis, bytes, step, position),
so that after a hang the files show where the ranks' sequences part (`find_mismatch`): the rank
that called a different collective, or none, at the same position is the cause. Each step ends
with a summary line (count, bytes and blocking seconds per op and axis, and PyTorch's
`CommDebugMode` counts per module for DTensor collectives).

What it cannot see: waits done inside C++ (classic DDP's reducer, NCCL stream waits a GPU kernel
queues without the host waiting), and on GPUs the time a kernel waits on a stream is not host
time. There the share reads low; the docs (docs/monitoring.md) say so. Waits on a group that is no
mesh axis (or whose group is not known at wait time) land in ``other``.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtorch.monitor.jsonl import read_jsonl

AXES = ("dp_replicate", "dp_shard", "tp", "cp", "pp", "other")
"""Axes reported, in a fixed order (the per-rank vector is gathered by position)."""

# c10d functions that take a process group (and maybe async_op); p2p ops and batch_isend_irecv
# are left alone (the pipeline schedule compares `P2POp.op` against `dist.isend` by identity):
# the schedule's waits for them are timed in its `_wait_batch_p2p` and counted on ``pp``.
_C10D = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
         "reduce_scatter_single", "reduce_scatter", "broadcast", "all_to_all_single", "barrier")

# functional collectives (what DTensor calls): their launches are timed, their waits in wait_tensor
_FUNCOL = ("broadcast", "all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_tensor",
           "reduce_scatter_tensor", "all_reduce_coalesced", "all_gather_single_coalesced",
           "reduce_scatter_single_coalesced", "all_to_all_single", "all_gather_inplace")

_lock = threading.Lock()
_active: CommTimer | None = None


class CommTimer:
    """Accumulates host-blocking communication seconds per axis for this process (one at a time).

    `install()` wraps torch's entry points (idempotent; `uninstall()` restores them). `seconds` is
    a dict axis -> seconds since creation; `snapshot()` copies it (the trainer takes one before and
    after forward/backward and keeps the difference)."""

    def __init__(self, mesh: Any = None):
        self.group_axis: dict[Any, str] = {}
        self.name_axis: dict[str, str] = {}
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ()) if mesh is not None else ()
        for name in names:
            try:
                pg = mesh.get_group(name)
            except Exception:  # noqa: BLE001 - a flattened or odd axis: not attributed
                continue
            axis = name if name in AXES else ("dp_shard" if name.startswith("dp_shard") else "other")
            self.group_axis[pg] = axis
            self.name_axis[getattr(pg, "group_name", "")] = axis
        self.seconds: dict[str, float] = dict.fromkeys(AXES, 0.0)
        self.calls = 0
        self._pending: dict[int, str] = {}
        self._last_funcol_axis = "other"
        self._saved: list[tuple[Any, str, Any]] = []
        # a blocking c10d call waits on its own Work inside: that wait is already in the call's time
        self._inside = threading.local()
        self._trace_fd: int | None = None
        self.step = 0
        self._index = 0
        self._step_stats: dict[str, list[float]] = {}

    # ---- tracing --------------------------------------------------------------------------------
    def trace_to(self, path: str | os.PathLike) -> None:
        """Append every launch (and per-step summaries) to `path`, one JSON object a line."""
        from dtorch import trust

        self._trace_fd = trust.open_append(path, "trace_comms")  # private, never through a planted link

    def _write(self, rec: dict[str, Any]) -> None:
        os.write(self._trace_fd, (json.dumps(rec, default=str) + "\n").encode())

    def _launch(self, op: str, axis: str, tensor: Any) -> None:
        nbytes = 0
        if hasattr(tensor, "numel"):
            nbytes = int(tensor.numel() * tensor.element_size())
        elif isinstance(tensor, (list, tuple)) and tensor and hasattr(tensor[0], "numel"):
            nbytes = int(sum(t.numel() * t.element_size() for t in tensor))
        self._write({"step": self.step, "i": self._index, "op": op, "axis": axis, "bytes": nbytes})
        self._index += 1
        st = self._step_stats.setdefault(f"{op}/{axis}", [0, 0, 0.0])
        st[0] += 1
        st[1] += nbytes

    def begin_step(self, step: int) -> None:
        self.step, self._index, self._step_stats = step, 0, {}

    def end_step(self, modules: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Write (and return) this step's summary when tracing."""
        if self._trace_fd is None:
            return None
        rec = {"step": self.step, "summary": {k: {"count": int(v[0]), "bytes": int(v[1]), "seconds": round(v[2], 6)}
                                              for k, v in self._step_stats.items()},
               "calls": self._index, "modules": modules or {}}
        self._write(rec)
        return rec

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)

    # ---- attribution -------------------------------------------------------------------------
    def _axis(self, group: Any) -> str:
        if group is None:
            # the default group: the only axis when the mesh has one, else not attributable
            return next(iter(self.group_axis.values())) if len(self.group_axis) == 1 else "other"
        return self.group_axis.get(group, "other")

    def _add(self, axis: str, dt: float) -> None:
        self.seconds[axis] = self.seconds.get(axis, 0.0) + dt
        self.calls += 1

    # ---- wrappers ------------------------------------------------------------------------------
    def _wrap_c10d(self, fn: Callable) -> Callable:
        params = list(inspect.signature(fn).parameters)
        gi = params.index("group") if "group" in params else None
        ai = params.index("async_op") if "async_op" in params else None

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            inside = self._inside
            if getattr(inside, "on", False):
                return fn(*args, **kwargs)
            if self._trace_fd is not None:
                group = kwargs.get("group", args[gi] if gi is not None and len(args) > gi else None)
                self._launch(fn.__name__, self._axis(group), args[0] if args else kwargs.get("tensor"))
            inside.on = True
            t = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                inside.on = False
            dt = time.perf_counter() - t
            group = kwargs.get("group", args[gi] if gi is not None and len(args) > gi else None)
            axis = self._axis(group)
            self._add(axis, dt)
            if self._trace_fd is not None:
                self._step_stats.setdefault(f"{fn.__name__}/{axis}", [0, 0, 0.0])[2] += dt
            is_async = kwargs.get("async_op", args[ai] if ai is not None and len(args) > ai else False)
            if is_async and out is not None:
                if len(self._pending) > 4096:  # works never waited on (fire and forget): forget them
                    self._pending.clear()
                self._pending[id(out)] = axis
            return out

        wrapper.__dtorch_comm_timer__ = fn  # type: ignore[attr-defined]
        return wrapper

    def _wrap_wait(self, fn: Callable) -> Callable:
        def wait(work, *args, **kwargs):
            if getattr(self._inside, "on", False):
                return fn(work, *args, **kwargs)
            t = time.perf_counter()
            out = fn(work, *args, **kwargs)
            self._add(self._pending.pop(id(work), "other"), time.perf_counter() - t)
            return out

        return wait

    def _wrap_resolve(self, fn: Callable) -> Callable:
        # every functional collective resolves its group first: torch 2.13's `_resolve_group`
        # returns the ProcessGroup or its name (older torch: `_resolve_group_name`, the name)
        def resolve(group, tag: str = ""):
            got = fn(group, tag)
            if isinstance(got, str):
                self._last_funcol_axis = self.name_axis.get(got, "other")
            else:
                self._last_funcol_axis = self.group_axis.get(got) or self.name_axis.get(
                    getattr(got, "group_name", ""), "other")
            if self._trace_fd is not None:  # the launch, named by the wrapper it runs in, if any
                op, tensor = getattr(self._inside, "funcol_op", None) or ("functional", None)
                self._launch(op, self._last_funcol_axis, tensor)
            return got

        return resolve

    def _wrap_funcol(self, fn: Callable) -> Callable:
        # the launch of a functional collective (enqueueing it, allocating its output) is time the
        # training thread spends on communication too: torch's profiler counts it, so do we
        @functools.wraps(fn)
        def launch(*args, **kwargs):
            inside = self._inside
            if getattr(inside, "funcol", False):
                return fn(*args, **kwargs)
            inside.funcol = True
            inside.funcol_op = (fn.__name__, args[0] if args else kwargs.get("self"))
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                inside.funcol = False
                inside.funcol_op = None
                dt = time.perf_counter() - t
                self._add(self._last_funcol_axis, dt)
                if self._trace_fd is not None:
                    self._step_stats.setdefault(f"{fn.__name__}/{self._last_funcol_axis}", [0, 0, 0.0])[2] += dt

        return launch

    def _wrap_wait_tensor(self, fn: Callable) -> Callable:
        def wait_tensor(tensor):
            if getattr(self._inside, "funcol", False):  # a synchronous launch: timed by it
                return fn(tensor)
            t = time.perf_counter()
            out = fn(tensor)
            dt = time.perf_counter() - t
            self._add(self._last_funcol_axis, dt)
            if self._trace_fd is not None:  # waits are not tied to one op: their own line per axis
                self._step_stats.setdefault(f"wait_tensor/{self._last_funcol_axis}", [0, 0, 0.0])[2] += dt
            return out

        return wait_tensor

    def _wrap_pp_wait(self, fn: Callable) -> Callable:
        def wait_batch_p2p(work):
            inside = self._inside
            if getattr(inside, "on", False):
                return fn(work)
            inside.on = True
            t = time.perf_counter()
            try:
                return fn(work)
            finally:
                inside.on = False
                self._add("pp", time.perf_counter() - t)

        return wait_batch_p2p

    def _patch(self, owner: Any, name: str, new: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def install(self) -> CommTimer:
        global _active
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d

        with _lock:
            if _active is self:
                return self
            if _active is not None:
                _active.uninstall()
            for name in _C10D:
                fn = getattr(c10d, name, None)
                if fn is None:
                    continue
                wrapped = self._wrap_c10d(fn)
                self._patch(c10d, name, wrapped)
                if getattr(dist, name, None) is fn:
                    self._patch(dist, name, wrapped)
            self._patch(c10d.Work, "wait", self._wrap_wait(c10d.Work.wait))
            # one of the two, never both (`_resolve_group_name` calls `_resolve_group`)
            resolver = "_resolve_group" if hasattr(funcol, "_resolve_group") else "_resolve_group_name"
            self._patch(funcol, resolver, self._wrap_resolve(getattr(funcol, resolver)))
            self._patch(funcol, "wait_tensor", self._wrap_wait_tensor(funcol.wait_tensor))
            for name in _FUNCOL:
                if hasattr(funcol, name):
                    self._patch(funcol, name, self._wrap_funcol(getattr(funcol, name)))
            try:  # the pipeline schedule waits for its sends/receives through this one function
                from torch.distributed.pipelining import schedules

                if hasattr(schedules, "_wait_batch_p2p"):
                    self._patch(schedules, "_wait_batch_p2p", self._wrap_pp_wait(schedules._wait_batch_p2p))
            except ImportError:
                pass
            _active = self
        return self

    def uninstall(self) -> None:
        global _active
        if self._trace_fd is not None:
            os.close(self._trace_fd)
            self._trace_fd = None
        for owner, name, old in reversed(self._saved):
            setattr(owner, name, old)
        self._saved.clear()
        if _active is self:
            _active = None


def trace_path(log_dir: str | os.PathLike, rank: int) -> str:
    return os.path.join(log_dir, f"comms-rank{rank}.jsonl")


def find_mismatch(log_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The first place where two ranks' collective sequences part, from the trace files of a run
    (`comms-rank*.jsonl`), or None when every rank launched the same sequence. The result names
    both ranks: `rank_a` (rank 0, or the lowest rank) and `rank_b`, the step, the position, and
    what each launched there (None: that rank launched nothing more, e.g. it is stuck elsewhere).
    Pipeline stages run different collectives by design: pass a run with pp=1, or read per stage."""
    import glob
    import re

    seqs: dict[int, dict[int, list[tuple]]] = {}
    for f in glob.glob(os.path.join(log_dir, "comms-rank*.jsonl")):
        m = re.search(r"comms-rank(\d+)\.jsonl$", f)
        if not m:
            continue
        per_step: dict[int, list[tuple]] = {}
        for rec in read_jsonl(Path(f)):
            if "op" in rec:
                per_step.setdefault(rec["step"], []).append((rec["op"], rec["axis"], rec["bytes"]))
        seqs[int(m.group(1))] = per_step
    if len(seqs) < 2:
        return None
    ranks = sorted(seqs)
    steps = sorted(set().union(*[set(s) for s in seqs.values()]))
    for step in steps:
        ref_rank = ranks[0]
        ref = seqs[ref_rank].get(step, [])
        for r in ranks[1:]:
            other = seqs[r].get(step, [])
            for i in range(max(len(ref), len(other))):
                a = ref[i] if i < len(ref) else None
                b = other[i] if i < len(other) else None
                if a != b:
                    return {"step": step, "index": i, "rank_a": ref_rank, "call_a": a, "rank_b": r, "call_b": b}
    return None


def describe_mismatch(m: dict[str, Any]) -> str:
    def call(c):
        return "nothing (it never reached a collective here: stuck or finished)" if c is None else \
            f"{c[0]} on {c[1]} ({c[2]:,} bytes)"

    return (f"collective sequences differ at step {m['step']}, collective #{m['index']}: rank {m['rank_a']} "
            f"launched {call(m['call_a'])}, rank {m['rank_b']} launched {call(m['call_b'])}; a collective that "
            f"its peers do not join waits forever: this is where the job hangs")
