"""The seam between the training loop and what watches it (heartbeat, chaos drills, stragglers).

The loop calls `before_step`, `after_step` and `phase(name)`; watchers register callbacks with
`register`. The trainer imports nothing of `dtorch.elastic`: when a run is launched by
`dtorch run` (DTORCH_RUN_DIR set), the elastic worker support registers itself at `started`.
Callbacks must be cheap: they run on the hot path of every step.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any

_before: list[Callable[[int], None]] = []
_after: list[Callable[[int, float], None]] = []
_phase: list[Callable[[str, int], None]] = []
_current_step = 0


def register(*, before_step: Callable[[int], None] | None = None,
             after_step: Callable[[int, float], None] | None = None,
             on_phase: Callable[[str, int], None] | None = None) -> None:
    """Add callbacks: before_step(step), after_step(step, loss), on_phase(name, step) at phase entry."""
    if before_step:
        _before.append(before_step)
    if after_step:
        _after.append(after_step)
    if on_phase:
        _phase.append(on_phase)


def clear() -> None:
    _before.clear()
    _after.clear()
    _phase.clear()


def started(trainer: Any) -> None:
    """Called once the trainer is set up; installs the elastic worker hooks under `dtorch run`."""
    if os.environ.get("DTORCH_RUN_DIR") or os.environ.get("DTORCH_CHAOS"):
        mod = importlib.import_module("dtorch.elastic.worker")
        install = getattr(mod, "install_hooks", None)
        if install is not None:
            install(trainer)


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
