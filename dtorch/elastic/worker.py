"""What a worker started by `dtorch run` sees, and the hooks the training loop calls.

    from dtorch.elastic import worker
    w = worker.info()                # rank, world_size, epoch (membership epoch), run_dir, ...
    for step in range(start, steps):
        worker.beat(step)            # progress for the hang detector; also fires chaos faults
        with worker.phase("allreduce", step):
            ...                      # a hang in here is reported as "in phase 'allreduce'"
        worker.step_done(step)       # the first one after a (re)start closes the recovery record
    worker.checkpoint_committed(step)   # lets the agent grow the job at this boundary

`setup()` runs once per process (the launcher's bootstrap calls it before the user script; every
hook calls it lazily too, so `--no-python` scripts work): parent-death signal, faulthandler on
SIGUSR1, heartbeat thread. Outside `dtorch run` (no DTORCH_RUN_DIR) every hook is a cheap no-op
apart from `info()`, which then describes a single process (or torchrun's environment).

Environment set by the launcher: DTORCH_RUN_DIR, DTORCH_EPOCH, DTORCH_AGENT_PID, DTORCH_CHAOS,
DTORCH_HEARTBEAT_INTERVAL, plus torchelastic's RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_RUN_ID.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dtorch import env, process_group
from dtorch.elastic import chaos, events, heartbeat

_PR_SET_PDEATHSIG = 1


@dataclass
class _WorkerState:
    """This process's worker state (one per process: `_state`)."""

    setup_done: bool = False
    first_step_logged: bool = False
    faulthandler_file: Any = None
    step_start_t: float = field(default_factory=time.time)
    """When the current step began (`step_begin`); `step_done` measures the first step from it."""
    hooks_installed: bool = False
    open_phase: tuple[str, float] | None = None
    """The trainer reports phase entries only: the phase open now and when it began."""
    pg_store: Any = None
    """The signed process-group store, kept referenced for the life of the process group."""


_state = _WorkerState()


@dataclass(frozen=True)
class WorkerInfo:
    """This worker's place in the job. `epoch` is the membership epoch: it changes whenever the
    worker group is (re)started (a failure or a resize), and is equal on every rank of a group."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    epoch: int
    restart_count: int
    run_id: str
    run_dir: str | None


def info() -> WorkerInfo:
    """This worker's rank, world size and membership epoch, from the launcher's environment."""
    e = env.current()
    return WorkerInfo(
        rank=e.rank or 0, local_rank=e.local_rank or 0, world_size=e.world_size or 1,
        local_world_size=e.local_world_size or 1, node_rank=e.group_rank,
        epoch=e.epoch if e.epoch is not None else e.restart_count, restart_count=e.restart_count,
        run_id=e.run_id, run_dir=e.run_dir)


def _set_pdeathsig() -> None:
    """Ask the kernel to SIGKILL us when our parent (the agent) dies, so no worker is orphaned
    when its agent is killed with SIGKILL. Linux only; elsewhere the heartbeat thread's parent
    check does the same job within one interval."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    agent = env.current().agent_pid
    if agent is not None and not agent_alive(agent):
        os._exit(70)  # the agent died before prctl: the signal will never come


def agent_alive(pid: int) -> bool:
    """Whether the agent process still exists. (Our parent is the agent, or with the forkserver
    start method the agent's forkserver, which exits when the agent dies.)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def setup() -> None:
    """Prepare this process as a DTorch worker (idempotent; no-op outside `dtorch run`)."""
    st = _state
    if st.setup_done:
        return
    st.setup_done = True
    st.step_start_t = time.time()  # the state may date from the forkserver's import
    e = env.current()
    run_dir = e.run_dir
    if not run_dir:
        return
    _set_pdeathsig()
    w = info()
    d = heartbeat.dump_dir(run_dir, w.epoch)
    os.makedirs(d, exist_ok=True)
    # faulthandler needs a file that stays open; it writes from the signal handler without the GIL,
    # so the C-level view of every thread appears even when Python cannot run.
    st.faulthandler_file = open(os.path.join(d, f"rank{w.rank}.faulthandler.txt"), "a")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=st.faulthandler_file, all_threads=True, chain=False)
    heartbeat.start(run_dir, w.rank, w.epoch, e.heartbeat_interval, e.agent_pid or None)
    events.log("worker_started", rank=w.rank, epoch=w.epoch, world_size=w.world_size)
    install_hooks()


def beat(step: int, phase: str = "step") -> None:
    """Mark progress of the training loop at `step` (call at least once per step), then give the
    chaos drill its chance to strike here."""
    setup()
    heartbeat.mark(step=step, phase=phase)
    chaos.maybe_inject(step, phase)


@contextlib.contextmanager
def phase(name: str, step: int | None = None) -> Iterator[None]:
    """Mark the training loop as inside `name` (e.g. "forward", "allreduce", "checkpoint").

    Recovery phases ("replan", "load") are also timed into the event log. Chaos faults with
    `phase=name` fire on entry."""
    setup()
    s = heartbeat.snapshot()["step"] if step is None else step
    heartbeat.mark(step=s, phase=name)
    chaos.maybe_inject(s, name)
    if name in events.RECOVERY_PHASES:
        with events.phase(name):
            yield
    else:
        yield
        heartbeat.mark(phase="step")


def step_done(step: int, start_t: float | None = None) -> None:
    """Report that `step` finished; the first call after a (re)start logs `first_step` with the
    step's duration (from `start_t`, wall seconds, default: the last phase mark)."""
    setup()
    heartbeat.mark(step=step, phase="step", step_done=True)
    if not _state.first_step_logged:
        _state.first_step_logged = True
        t0 = start_t if start_t is not None else _state.step_start_t
        events.log("first_step", step=step, start=t0, seconds=time.time() - t0)


def step_begin(step: int, phase: str = "forward") -> None:
    """Mark the start of `step` (sets the start time `step_done` measures from) and beat in `phase`."""
    _state.step_start_t = time.time()
    beat(step, phase)


# ---- the trainer's seam (dtorch.train.hooks): entry-only phase callbacks --------------------------
# The seam is one-way and carries values, never the trainer: the trainer restores in-memory
# snapshots itself (dtorch.checkpoint.resume) and reports commits through `hooks.committed`.


def _close_phase() -> None:
    """The trainer reports phase entries only: a phase ends at the next hook call."""
    if _state.open_phase is not None:
        name, t0 = _state.open_phase
        _state.open_phase = None
        if name in events.RECOVERY_PHASES:
            events.log("phase", name=name, start=t0, seconds=time.time() - t0, ok=True)


def _on_phase(name: str, step: int) -> None:
    _close_phase()
    heartbeat.mark(step=step, phase=name)
    chaos.maybe_inject(step, name)
    _state.open_phase = (name, time.time())


def _on_before_step(step: int) -> None:
    _close_phase()
    step_begin(step, "step")


def _on_after_step(step: int, loss: float) -> None:
    _close_phase()
    first = not _state.first_step_logged
    step_done(step)
    if first:
        # After the first step (process-group warm-up, first checkpoint load) a peer that died or
        # stopped should fail a collective in seconds, not after gloo's 30 minutes.
        import torch.distributed as dist

        if dist.is_initialized():
            set_collective_timeout(env.current().collective_timeout)


def _on_started(trainer: Any) -> None:
    """The trainer is set up: its last phase ends here."""
    _close_phase()


def install_hooks(trainer: Any = None) -> None:
    """Connect this worker to DTorch's trainer through `dtorch.train.hooks` (idempotent): progress
    beats and chaos points at every step and phase (`load`, `forward_backward`, `optimizer`,
    `checkpoint`), the `load` phase timed into the recovery record, checkpoint commits published
    for growing, the first step after a restart. Called by `setup()` under `dtorch run` (so `load`
    is seen). `trainer` is accepted for older callers and not used."""
    _close_phase()
    if _state.hooks_installed or not env.current().run_dir:
        return
    _state.hooks_installed = True
    from dtorch.train import hooks  # the seam is one-way: this side registers, the trainer only calls

    hooks.register(before_step=_on_before_step, after_step=_on_after_step, on_phase=_on_phase,
                   on_started=_on_started, on_notice=_on_notice, on_committed=_on_commit)


def _on_notice(kind: str, fields: dict[str, Any]) -> None:
    """The trainer's notices (a straggler named, a snapshot restored, ...) go to the event log,
    where the agent's detectors and the recovery record read them."""
    events.log(kind, **fields)


def _on_commit(step: int) -> None:
    """From the trainer, the moment a save has committed: publish it now, so that an agent that
    stops the group right after knows which checkpoint the next group resumes from, and may grow
    the job at this boundary (never at a save that has only started: a restart would kill it)."""
    heartbeat.mark(committed_step=step)
    heartbeat.flush()


def checkpoint_committed(step: int) -> None:
    """Report that the checkpoint of `step` is durable; the agent lets waiting nodes join the job
    (grow) only at such a boundary, so growing loses no work."""
    setup()
    heartbeat.mark(committed_step=step)


def set_collective_timeout(seconds: float, group: Any = None) -> None:
    """Shorten (or lengthen) the timeout of the process group's collectives, e.g. after the first
    step, so a dead or stopped peer fails a collective in seconds instead of 30 minutes (gloo's
    default); see `dtorch.process_group.set_collective_timeout`."""
    process_group.set_collective_timeout(seconds, group)


def nccl_flight_recorder(w: WorkerInfo) -> str | None:
    """Before an NCCL process group exists: keep torch's flight recorder on (the launcher's
    TORCH_FR_BUFFER_SIZE, also under its older name TORCH_NCCL_TRACE_BUFFER_SIZE) and have the NCCL
    watchdog dump it on a collective timeout into <run_dir>/dumps/epoch<E>/nccl/rank_<R>, where the
    hang report reads it (`dtorch.elastic.heartbeat.diagnose`). The user's own settings win.
    Returns the dump directory (None outside `dtorch run`)."""
    from dtorch.elastic import heartbeat

    have = env.environ()
    size = have.get("TORCH_FR_BUFFER_SIZE") or have.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or "2000"
    want = {"TORCH_FR_BUFFER_SIZE": size, "TORCH_NCCL_TRACE_BUFFER_SIZE": size, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    d = None
    if w.run_dir:
        d = os.path.join(heartbeat.dump_dir(w.run_dir, w.epoch), heartbeat.NCCL_DUMP_DIR)
        os.makedirs(d, exist_ok=True)
        want["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(d, "rank_")
    env.export({k: v for k, v in want.items() if k not in have})
    return d


def init_process_group(backend: str | None = None, timeout: float | None = None) -> None:
    """`torch.distributed.init_process_group` for a worker of `dtorch run`, with its store listening
    on MASTER_ADDR only (`dtorch.process_group.init_process_group`, which DTorch's trainer calls
    too) and its values authenticated with the job's key (`SignedStore`, gloo), after this worker's
    set-up (and, on NCCL, the flight recorder's settings) and timed into the recovery record as
    `pg_init`. `timeout` in
    seconds (default torch's); shorten it after the first step with `set_collective_timeout`."""
    setup()
    import torch

    w = info()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        nccl_flight_recorder(w)
    e = env.current()
    keyed = e.run_dir or e.key or e.key_file
    # Under `dtorch run` every rank has the key its agents' rendezvous is signed with; ranks a
    # scheduler started sign only with a key given explicitly (a per-user key file on nodes that do
    # not share a home directory would differ). NCCL over this Python store is untested (no GPU
    # build here), so its store stays as torch makes it.
    wrap = (lambda inner: _signed_pg_store(inner, w)) if keyed and backend == "gloo" else None
    with events.phase("pg_init"):
        process_group.init_process_group(backend, timeout, wrap_store=wrap)


def _signed_pg_store(inner: Any, w: WorkerInfo) -> Any:
    """The process-group store with its values authenticated for this round (run id, membership
    epoch, port) with the job's secret (`dtorch.elastic.store.SignedStore`). Kept referenced for
    the life of the process group."""
    from dtorch import trust
    from dtorch.elastic import store as _store

    _state.pg_store = _store.SignedStore(inner, trust.secret(), f"{w.run_id}|{w.epoch}|{env.current().master_port}")
    return _state.pg_store
