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
from dataclasses import dataclass
from typing import Any

from dtorch import process_group
from dtorch.elastic import chaos, events, heartbeat

_PR_SET_PDEATHSIG = 1
_setup_done = False
_first_step_logged = False
_faulthandler_file = None


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
    env = os.environ
    return WorkerInfo(
        rank=int(env.get("RANK", "0")), local_rank=int(env.get("LOCAL_RANK", "0")),
        world_size=int(env.get("WORLD_SIZE", "1")), local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
        node_rank=int(env.get("GROUP_RANK", "0")),
        epoch=int(env.get("DTORCH_EPOCH", env.get("TORCHELASTIC_RESTART_COUNT", "0"))),
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        run_id=env.get("TORCHELASTIC_RUN_ID", "local"), run_dir=env.get("DTORCH_RUN_DIR"))


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
    agent = os.environ.get("DTORCH_AGENT_PID")
    if agent is not None and not agent_alive(int(agent)):
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
    global _setup_done, _faulthandler_file
    global _step_start_t
    if _setup_done:
        return
    _setup_done = True
    _step_start_t = time.time()  # module globals may date from the forkserver's import
    run_dir = os.environ.get("DTORCH_RUN_DIR")
    if not run_dir:
        return
    _set_pdeathsig()
    w = info()
    d = heartbeat.dump_dir(run_dir, w.epoch)
    os.makedirs(d, exist_ok=True)
    # faulthandler needs a file that stays open; it writes from the signal handler without the GIL,
    # so the C-level view of every thread appears even when Python cannot run.
    _faulthandler_file = open(os.path.join(d, f"rank{w.rank}.faulthandler.txt"), "a")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_faulthandler_file, all_threads=True, chain=False)
    agent = os.environ.get("DTORCH_AGENT_PID")
    heartbeat.start(run_dir, w.rank, w.epoch, float(os.environ.get("DTORCH_HEARTBEAT_INTERVAL", "0.5")),
                    int(agent) if agent else None)
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
    global _first_step_logged
    setup()
    heartbeat.mark(step=step, phase="step", step_done=True)
    if not _first_step_logged:
        _first_step_logged = True
        t0 = start_t if start_t is not None else _step_start_t
        events.log("first_step", step=step, start=t0, seconds=time.time() - t0)


_step_start_t = time.time()


def step_begin(step: int, phase: str = "forward") -> None:
    """Mark the start of `step` (sets the start time `step_done` measures from) and beat in `phase`."""
    global _step_start_t
    _step_start_t = time.time()
    beat(step, phase)


# ---- the trainer's seam (dtorch.train.hooks): entry-only phase callbacks --------------------------
_hooks_installed = False
_open_phase: tuple[str, float] | None = None
_trainer: Any = None
_reported_commit: int | None = None
_snap: Any = None
_snap_every = 0


def _start_snapshots(trainer: Any) -> None:
    """Under `dtorch run` with DTORCH_SNAPSHOT_DIR: restore the newest in-memory snapshot when it
    is newer than the durable checkpoint the trainer just loaded, then snapshot every
    DTORCH_SNAPSHOT_EVERY steps (see `dtorch.checkpoint.snapshot`). Collective."""
    global _snap, _snap_every
    d = os.environ.get("DTORCH_SNAPSHOT_DIR")
    _snap_every = int(os.environ.get("DTORCH_SNAPSHOT_EVERY", "1") or 0)
    if not d or _snap_every <= 0 or not callable(getattr(trainer, "checkpoint_state", None)):
        return
    from dtorch.checkpoint.snapshot import Snapshotter

    plan = getattr(trainer, "plan", None)
    tag = f"{plan.describe() if plan is not None else ''}|seed={getattr(trainer, 'seed', '')}"
    group, peer, source = _replication(trainer)
    # DTORCH_SNAPSHOT_BACKGROUND=0: copy on the training thread (the benchmark compares both)
    _snap = Snapshotter(d, trainer.rank, trainer.world, tag=tag,
                        background=os.environ.get("DTORCH_SNAPSHOT_BACKGROUND", "1") != "0",
                        group=group, peer=peer, source=source)
    durable = trainer.step
    t0 = time.time()
    step = _snap.restore(_snapshot_state(trainer), durable_step=durable)
    if trainer.rank == 0:  # every rank knows every skipped copy: one record each
        for bad in _snap.rejected:
            events.log("snapshot_rejected", snapshot_rank=bad["rank"], step=bad["step"], held=bad["held"],
                       why=bad["why"])
            print(f"dtorch: in-memory snapshot of rank {bad['rank']} at step {bad['step']} ({bad['held']} node) "
                  f"skipped: {bad['why']}; using the next source", file=sys.stderr, flush=True)
    ckpt = getattr(trainer, "ckpt", None)
    if step is None and getattr(ckpt, "deferred_to_snapshot", None) is not None:
        # the trainer skipped its checkpoint load for a snapshot that is not usable after all
        # (another plan): load the checkpoint now, as the trainer would have
        ckpt.deferred_to_snapshot = None
        ckpt.defer_to_snapshots = False
        with events.phase("load"):
            got = ckpt.load_latest(trainer.checkpoint_state())
        trainer.step = trainer.train_state.step if got is not None else 0
        return
    if step is not None:
        trainer.step = trainer.train_state.step
        events.log("phase", name="snapshot_restore", start=t0, seconds=time.time() - t0, ok=True, step=step,
                   durable_step=durable, from_peer=list(getattr(_snap, "restored_from", [])))
        if trainer.rank == 0:
            # a deferred load read no checkpoint: name the newest one the snapshot was newer than
            durable = durable or getattr(ckpt, "deferred_checkpoint", None)
            print(f"dtorch: restored the in-memory snapshot of step {step} (newer than "
                  f"{'the durable checkpoint of step ' + str(durable) if durable else 'any durable checkpoint: none was written yet'})",
                  file=sys.stderr, flush=True)


def _replication(trainer: Any) -> tuple[Any, int | None, int | None]:
    """On more than one node: a gloo group of its own for snapshot replication and this rank's
    (peer, source) (`dtorch.checkpoint.snapshot.peer_ranks`: the same local rank on the next and
    the previous node), so that a node's loss leaves a copy of its ranks' snapshots on another
    node. (None, None, None) on one node or with DTORCH_SNAPSHOT_PEER=0. Collective."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None, None, None
    from dtorch.checkpoint.snapshot import peer_ranks

    me = (int(os.environ.get("GROUP_RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")),
          os.environ.get("DTORCH_SNAPSHOT_PEER", "1") != "0")
    nodes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, me)
    if not all(n[2] for n in nodes) or len({n[0] for n in nodes}) < 2:
        return None, None, None
    from datetime import timedelta

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=float(os.environ.get("DTORCH_COLLECTIVE_TIMEOUT", "120"))))
    peer, source = peer_ranks([(n[0], n[1]) for n in nodes], dist.get_rank())
    return group, peer, source


_live: Any = None


def _live_modules(parts: list[Any]) -> Any:
    """The model parts for snapshots, one object per run so that its state dict is reused while
    the parameters stay the same (`dtorch.checkpoint.snapshot.LiveModules`)."""
    global _live
    if _live is None or _live.modules != parts:
        from dtorch.checkpoint.snapshot import LiveModules

        _live = LiveModules(parts)
    return _live


_live_optim: Any = None


def _live_optimizers(optims: list[Any]) -> Any:
    """The optimizers for snapshots, one object per run: their per-parameter state is reused
    (`dtorch.checkpoint.snapshot.LiveOptimizers`)."""
    global _live_optim
    if _live_optim is None or _live_optim.optimizers != optims:
        from dtorch.checkpoint.snapshot import LiveOptimizers

        _live_optim = LiveOptimizers(optims)
    return _live_optim


def _snapshot_state(trainer: Any) -> dict[str, Any]:
    """What a snapshot holds: everything a checkpoint holds, model and optimizer natively (for a
    snapshot of the same plan the native state dicts are exact and far cheaper than the
    distributed-checkpoint helpers that a durable, reshardable checkpoint needs)."""
    state = dict(trainer.checkpoint_state())
    parts, optims = getattr(getattr(trainer, "parallel", None), "model_parts", None), getattr(trainer, "optimizers", None)
    if parts is not None and optims is not None and "model" in state and "optim" in state:
        state["model"], state["optim"] = _live_modules(list(parts)), _live_optimizers(list(optims))
    return state


def _take_snapshot(step: int) -> None:
    if _snap is None or step % _snap_every:
        return
    before = len(_snap.stall_s)
    _snap.take(step, _snapshot_state(_trainer))
    n = len(_snap.stall_s)
    if n > before and n % 10 == 1 and n > 1:  # the stall of the last 10 takes (their waits are in), for the benchmark
        recent = sorted(_snap.stall_s[-11:-1])
        parts = {k: sorted(v[-10:])[len(v[-10:]) // 2] for k, v in _snap.parts_s.items() if v}
        events.log("snapshot_stall", step=step, takes=n - 1, median_s=recent[len(recent) // 2], max_s=recent[-1],
                   parts_median_s=parts)


def _report_commit() -> None:
    """Report the trainer's last *committed* checkpoint (directory renamed, LATEST moved: the
    manager's `last_committed`), never a save that has only started: the agent grows the job at
    that boundary and restarts the workers, which would kill an async save mid-write."""
    global _reported_commit
    step = getattr(getattr(_trainer, "ckpt", None), "last_committed", None)
    if step is not None and step != _reported_commit:
        _reported_commit = step
        checkpoint_committed(step)


def _close_phase() -> None:
    """The trainer reports phase entries only: a phase ends at the next hook call."""
    global _open_phase
    if _open_phase is not None:
        name, t0 = _open_phase
        _open_phase = None
        if name in events.RECOVERY_PHASES:
            events.log("phase", name=name, start=t0, seconds=time.time() - t0, ok=True)
    _report_commit()


def _on_phase(name: str, step: int) -> None:
    global _open_phase
    _close_phase()
    if _snap is not None:
        # the last step's snapshot copy ran alongside this step's data loading: join it before the
        # step touches the state, so a failure from here on finds the previous step complete
        _snap.wait()
    heartbeat.mark(step=step, phase=name)
    chaos.maybe_inject(step, name)
    _open_phase = (name, time.time())


def _on_before_step(step: int) -> None:
    _close_phase()
    step_begin(step, "step")


def _on_after_step(step: int, loss: float) -> None:
    _close_phase()
    _take_snapshot(step)
    first = not _first_step_logged
    step_done(step)
    if first:
        # After the first step (process-group warm-up, first checkpoint load) a peer that died or
        # stopped should fail a collective in seconds, not after gloo's 30 minutes.
        import torch.distributed as dist

        if dist.is_initialized():
            set_collective_timeout(float(os.environ.get("DTORCH_COLLECTIVE_TIMEOUT", "120")))


def install_hooks(trainer: Any = None) -> None:
    """Connect this worker to DTorch's trainer through `dtorch.train.hooks` (idempotent): progress
    beats and chaos points at every step and phase (`load`, `forward_backward`, `optimizer`,
    `checkpoint`), the `load` phase timed into the recovery record, checkpoint boundaries for
    growing, the first step after a restart. Called by `setup()` under `dtorch run` (so `load`
    is seen), and through the seam by the trainer's `hooks.started(trainer)`."""
    global _hooks_installed, _trainer
    if trainer is not None:
        _trainer = trainer
        ckpt = getattr(trainer, "ckpt", None)
        if ckpt is not None and hasattr(ckpt, "on_commit") and os.environ.get("DTORCH_RUN_DIR"):
            ckpt.on_commit = _on_commit
        _close_phase()  # the trainer's last phase ends here, before the snapshot restore (timed apart)
        if os.environ.get("DTORCH_RUN_DIR"):
            _start_snapshots(trainer)
    _close_phase()
    if _hooks_installed or not os.environ.get("DTORCH_RUN_DIR"):
        return
    _hooks_installed = True
    from dtorch.train import hooks  # the seam is one-way: this side registers, the trainer only calls

    hooks.register(before_step=_on_before_step, after_step=_on_after_step, on_phase=_on_phase,
                   on_started=install_hooks, on_notice=_on_notice)


def _on_notice(kind: str, fields: dict[str, Any]) -> None:
    """The trainer's notices (a straggler named, ...) go to the event log, where the agent's
    detectors read them (`dtorch.elastic.agent.StragglerDetector`)."""
    events.log(kind, **fields)


def _on_commit(step: int) -> None:
    """From the checkpoint manager, the moment a save has committed: publish it now, so that an
    agent that stops the group right after knows which checkpoint the next group resumes from."""
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

    env = os.environ
    size = env.get("TORCH_FR_BUFFER_SIZE") or env.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or "2000"
    env.setdefault("TORCH_FR_BUFFER_SIZE", size)
    env.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", size)
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if not w.run_dir:
        return None
    d = os.path.join(heartbeat.dump_dir(w.run_dir, w.epoch), heartbeat.NCCL_DUMP_DIR)
    os.makedirs(d, exist_ok=True)
    env.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(d, "rank_"))
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
    keyed = os.environ.get("DTORCH_RUN_DIR") or os.environ.get("DTORCH_KEY") or os.environ.get("DTORCH_KEY_FILE")
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
    global _pg_store
    from dtorch import trust
    from dtorch.elastic import store as _store

    _pg_store = _store.SignedStore(inner, trust.secret(), f"{w.run_id}|{w.epoch}|{os.environ['MASTER_PORT']}")
    return _pg_store


_pg_store: Any = None
