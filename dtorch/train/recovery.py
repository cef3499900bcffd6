"""The trainer's side of resuming: its resume chooser (`dtorch.checkpoint.resume`) with the sources
this process has, the state a snapshot holds, and what is said about where the run resumed from."""

from __future__ import annotations

import sys
from typing import Any

from dtorch.checkpoint.resume import ResumeChooser, Resumed, snapshot_source
from dtorch.plan.plan import Plan
from dtorch.train import hooks

Trainer = Any
"""A `dtorch.train.trainer.Trainer` (not imported: the trainer imports this module)."""


class SnapshotState:
    """What a snapshot holds: everything a checkpoint holds, model and optimizer natively (for a
    snapshot of the same plan the native state dicts are exact and far cheaper than the
    distributed-checkpoint helpers that a durable, reshardable checkpoint needs). One object per
    run, so that the model's and optimizers' state dicts are reused while they stay the same."""

    def __init__(self, tr: Trainer):
        self.tr = tr
        self.live: Any = None
        self.live_optim: Any = None

    def __call__(self) -> dict[str, Any]:
        from dtorch.checkpoint.snapshot import LiveModules, LiveOptimizers

        tr = self.tr
        state = dict(tr.checkpoint_state())
        parts, optims = list(tr.parallel.model_parts), list(tr.optimizers)
        if self.live is None or self.live.modules != parts:
            self.live = LiveModules(parts)
        if self.live_optim is None or self.live_optim.optimizers != optims:
            self.live_optim = LiveOptimizers(optims)
        state["model"], state["optim"] = self.live, self.live_optim
        return state


def chooser(tr: Trainer) -> ResumeChooser:
    """The resume chooser over this process's sources: the checkpoint directory and, under
    `dtorch run`, the in-memory snapshots it hands its workers (`tr.env`). Collective."""
    tag = f"{tr.plan.describe()}|seed={tr.seed}"
    return ResumeChooser(tr.ckpt, snapshot_source(tr.env, tag, tr.rank, tr.world))


def resume(tr: Trainer) -> Resumed:
    """Restore the newest usable state into the trainer and say where it came from. Collective."""
    resumed = tr.resume_chooser.choose(tr.checkpoint_state, tr.snapshot_state, lambda: tr.train_state.step,
                                       phase=hooks.phase)
    tr.step = tr.train_state.step if resumed.step is not None else 0
    if resumed.checkpoint_step is not None:
        _checkpoint_loaded(tr, resumed)
    for bad in resumed.rejected:
        if tr.rank == 0:  # every rank knows every skipped copy: one record each
            hooks.notice("snapshot_rejected", snapshot_rank=bad["rank"], step=bad["step"], held=bad["held"],
                         why=bad["why"])
            print(f"dtorch: in-memory snapshot of rank {bad['rank']} at step {bad['step']} ({bad['held']} node) "
                  f"skipped: {bad['why']}; using the next source", file=sys.stderr, flush=True)
    if resumed.source in ("snapshot", "peer"):
        hooks.notice("phase", name="snapshot_restore", start=resumed.snapshot_t0, seconds=resumed.snapshot_s,
                     ok=True, step=resumed.step, durable_step=resumed.checkpoint_step or 0,
                     from_peer=resumed.from_peer)
        if tr.rank == 0:
            # a deferred load read no checkpoint: name the newest one the snapshot was newer than
            durable = resumed.checkpoint_step or resumed.newest_checkpoint
            print(f"dtorch: restored the in-memory snapshot of step {resumed.step} (newer than "
                  f"{'the durable checkpoint of step ' + str(durable) if durable else 'any durable checkpoint: none was written yet'})",
                  file=sys.stderr, flush=True)
    return resumed


def _checkpoint_loaded(tr: Trainer, resumed: Resumed) -> None:
    """The `resume` event and console line of a checkpoint read at start."""
    info = tr.ckpt.loaded
    old = Plan.from_dict(info.plan) if info and info.plan else None
    changed = old is not None and (old.world_size != tr.plan.world_size or old.mesh_shape != tr.plan.mesh_shape)
    from dtorch.train.build import resume_changes

    changes = resume_changes(tr, info.extra if info else {})
    tr.metrics.event("resume", step=resumed.checkpoint_step, seconds=resumed.load_s,
                     from_plan=old.describe() if old else None, resharded=changed, **({"changed": changes} if changes else {}))
    for c in changes if tr.rank == 0 else ():
        print(f"dtorch: warning: since the checkpoint of step {resumed.checkpoint_step}, {c}", file=sys.stderr, flush=True)
    if tr.rank == 0 and tr.console:
        how = f", resharded from {old.family()} at world size {old.world_size}" if changed else ""
        print(f"dtorch: resumed from step {resumed.checkpoint_step}{how}", flush=True)

