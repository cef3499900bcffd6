"""The seam between the training loop and what watches it (heartbeat, chaos drills, stragglers).

The loop calls `before_step`, `after_step`, `phase(name)`, `started(trainer)` once it is set up,
`committed(step)` the moment a checkpoint has committed (from the save's thread for an async save),
and `notice(kind, **fields)` for what a watcher should know (a straggler named); watchers register
callbacks with `register`. The seam is one-way: the trainer imports nothing of `dtorch.elastic`;
under `dtorch run` the elastic worker support (`dtorch.elastic.worker.setup`, which the launcher's
bootstrap runs before the script's first line) registers itself here. Callbacks must be cheap:
they run on the hot path of every step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

_before: list[Callable[[int], None]] = []
_after: list[Callable[[int, float], None]] = []
_phase: list[Callable[[str, int], None]] = []
_started: list[Callable[[Any], None]] = []
_notice: list[Callable[[str, dict[str, Any]], None]] = []
_committed: list[Callable[[int], None]] = []
_current_step = 0


def register(*, before_step: Callable[[int], None] | None = None,
             after_step: Callable[[int, float], None] | None = None,
             on_phase: Callable[[str, int], None] | None = None,
             on_started: Callable[[Any], None] | None = None,
             on_notice: Callable[[str, dict[str, Any]], None] | None = None,
             on_committed: Callable[[int], None] | None = None) -> None:
    """Add callbacks: before_step(step), after_step(step, loss), on_phase(name, step) at phase entry,
    on_started(trainer) once the trainer is set up, on_notice(kind, fields) for `notice`,
    on_committed(step) for `committed`."""
    for cb, into in ((before_step, _before), (after_step, _after), (on_phase, _phase), (on_started, _started),
                     (on_notice, _notice), (on_committed, _committed)):
        if cb:
            into.append(cb)  # type: ignore[attr-defined]


def clear() -> None:
    for cbs in (_before, _after, _phase, _started, _notice, _committed):
        cbs.clear()


def started(trainer: Any) -> None:
    """Called once the trainer is set up (process group, plan, model, checkpoint loaded)."""
    for cb in list(_started):
        cb(trainer)


def notice(kind: str, **fields: Any) -> None:
    """Tell the watchers something they may record or act on, e.g. `notice("straggler", step=..,
    ranks=[..], ratio=[..])` (JSON-serialisable fields)."""
    for cb in _notice:
        cb(kind, fields)


def committed(step: int) -> None:
    """The checkpoint of `step` has committed (directory renamed, LATEST moved)."""
    for cb in list(_committed):
        cb(step)


def before_step(step: int) -> None:
    global _current_step
    _current_step = step
    for cb in _before:
        cb(step)


def after_step(step: int, loss: float) -> None:
    for cb in _after:
        cb(step, loss)


def phase_begin(name: str) -> None:
    """Mark the entry into phase `name`; it lasts until the next phase or step mark."""
    for cb in _phase:
        cb(name, _current_step)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a phase of the current step (forward_backward, optimizer, checkpoint, load)."""
    phase_begin(name)
    yield
