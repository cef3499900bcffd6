"""Where a run resumes from: one chooser over explicit sources, returning (step, source).

The sources, newest state wins:

- durable: the newest committed checkpoint that verifies (`CheckpointManager.load_latest`);
- snapshot: this node's in-memory snapshot of every rank (`Snapshotter`, under `dtorch run`);
- peer: a rank's snapshot replicated on the next node (the same `Snapshotter.restore` receives it).

When every rank's snapshot is newer than every checkpoint, the checkpoint is not read at all (a
recovery's largest cost); a snapshot that turns out unusable (another plan, a copy that does not
verify) falls back to the checkpoint. The trainer owns the chooser and builds its sources from the
typed environment (`snapshot_source`); nothing else restores state.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dtorch.checkpoint.snapshot import Snapshotter, common_steps, inventory

SOURCES = ("none", "checkpoint", "snapshot", "peer")


@dataclass(frozen=True)
class Resumed:
    """What `ResumeChooser.choose` restored."""

    step: int | None
    """The step the state now holds; None: a fresh start."""
    source: str
    """One of `SOURCES`: nothing, the durable checkpoint, this node's snapshot, a peer node's replica."""
    checkpoint_step: int | None = None
    """The checkpoint read before the snapshots were consulted (None: none, or deferred to a snapshot)."""
    newest_checkpoint: int | None = None
    """The newest committed checkpoint's step, read or passed over (for saying what a snapshot beat)."""
    load_s: float = 0.0
    """Seconds of the first checkpoint load."""
    snapshot_s: float = 0.0
    snapshot_t0: float = 0.0
    """Wall-clock start of the snapshot restore (for the recovery record)."""
    rejected: list[dict[str, Any]] = field(default_factory=list)
    """Snapshot copies skipped because they did not verify (`Snapshotter.rejected`)."""
    from_peer: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class SnapshotSource:
    """The in-memory snapshots: this node's and, replicated, its peer node's."""

    snapshotter: Snapshotter
    directory: str
    every: int


def snapshot_source(run_env: Any, tag: str, rank: int, world: int) -> SnapshotSource | None:
    """The snapshot source `dtorch run` hands its workers (DTORCH_SNAPSHOT_DIR, _EVERY, _BACKGROUND,
    _PEER in `run_env`, a `dtorch.env.RuntimeEnv`), or None outside it. Collective."""
    if not (run_env.run_dir and run_env.snapshot_dir) or run_env.snapshot_every <= 0:
        return None
    group, peer, source = _replication(run_env)
    # DTORCH_SNAPSHOT_BACKGROUND=0: copy on the training thread (the benchmark compares both)
    snap = Snapshotter(run_env.snapshot_dir, rank, world, tag=tag, background=run_env.snapshot_background,
                       group=group, peer=peer, source=source)
    return SnapshotSource(snap, run_env.snapshot_dir, run_env.snapshot_every)


def _replication(run_env: Any) -> tuple[Any, int | None, int | None]:
    """On more than one node: a gloo group of its own for snapshot replication and this rank's
    (peer, source) (`dtorch.checkpoint.snapshot.peer_ranks`: the same local rank on the next and
    the previous node), so that a node's loss leaves a copy of its ranks' snapshots on another
    node. (None, None, None) on one node or with DTORCH_SNAPSHOT_PEER=0. Collective."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None, None, None
    from dtorch.checkpoint.snapshot import peer_ranks

    me = (run_env.group_rank, run_env.local_rank or 0, run_env.snapshot_peer)
    nodes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, me)
    if not all(n[2] for n in nodes) or len({n[0] for n in nodes}) < 2:
        return None, None, None
    from datetime import timedelta

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=run_env.collective_timeout))
    peer, source = peer_ranks([(n[0], n[1]) for n in nodes], dist.get_rank())
    return group, peer, source


class ResumeChooser:
    """Restores the newest usable state from `durable` (a `CheckpointManager`, or None) and
    `snapshots` (a `SnapshotSource`, or None). Collective."""

    def __init__(self, durable: Any, snapshots: SnapshotSource | None):
        self.durable = durable
        self.snapshots = snapshots

    def choose(self, state: Callable[[], dict[str, Any]], snapshot_state: Callable[[], dict[str, Any]],
               step_of: Callable[[], int], phase: Callable[[str], Any] = lambda name: contextlib.nullcontext()
               ) -> Resumed:
        """Restore into `state()` (a checkpoint's tree) or `snapshot_state()` (a snapshot's); `step_of()`
        reads the step the state holds after a load; `phase(name)` marks the "load" and
        "snapshot_restore" phases. Returns the step and its source."""
        durable, snaps = self.durable, self.snapshots
        step, source, ckpt_step, newest, load_s, deferred = None, "none", None, None, 0.0, False
        if durable is not None:
            with phase("load"):
                t = time.perf_counter()
                steps = durable.committed_steps()
                newest = steps[0] if steps else None
                snap = self._snapshot_step() if snaps is not None else None
                # every rank holds a snapshot newer than any checkpoint: no need to read one
                deferred = snap is not None and (newest is None or snap > newest)
                if not deferred and durable.load_latest(state()) is not None:
                    step = ckpt_step = step_of()
                    source = "checkpoint"
                load_s = time.perf_counter() - t
        if snaps is None:
            return Resumed(step, source, ckpt_step, newest, load_s)
        with phase("snapshot_restore"):
            t0, t = time.time(), time.perf_counter()
            got = snaps.snapshotter.restore(snapshot_state(), durable_step=step or 0)
            snap_s = time.perf_counter() - t
        rejected, from_peer = list(snaps.snapshotter.rejected), list(getattr(snaps.snapshotter, "restored_from", []))
        if got is not None:
            return Resumed(step_of(), "peer" if from_peer else "snapshot", ckpt_step, newest, load_s, snap_s, t0,
                           rejected, from_peer)
        if deferred:
            # the checkpoint load was skipped for a snapshot that is not usable after all (another
            # plan): load the checkpoint now
            with phase("load"):
                if durable.load_latest(state()) is not None:
                    step, source = step_of(), "checkpoint"
        return Resumed(step, source, ckpt_step, newest, load_s, snap_s, t0, rejected, from_peer)

    def _snapshot_step(self) -> int | None:
        """Collective: the newest step of which every rank's in-memory snapshot for this world
        size is held by some node, or None."""
        d = self.durable
        # a rank's snapshot may be held by its own node or, replicated, by its peer node
        invs = d._all_gather(inventory(self.snapshots.directory, d.world_size))
        return max(common_steps(invs, d.world_size), default=None)

