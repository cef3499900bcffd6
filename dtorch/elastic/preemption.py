"""Telling the workers that a SIGTERM means "checkpoint and stop", not "die now".

The agent stops its workers with SIGTERM in two cases: a restart (a rank failed; the survivors
should go at once) and its own SIGTERM from outside (the kubelet preempting the pod, scancel):
then the workers should checkpoint within the grace period (`dtorch.train.preempt`). Before
torch's handler turns the agent's SIGTERM into the workers' SIGTERM, `arm` writes
`<run_dir>/preempt.<agent pid>`; a worker that finds it treats its SIGTERM as a preemption.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from dtorch.env import current


def marker(run_dir: str, agent_pid: int | str) -> str:
    return os.path.join(run_dir, f"preempt.{agent_pid}")


def clear(run_dir: str) -> None:
    """At agent start: a marker left by an earlier agent with this pid (PID 1 in a restarted pod)."""
    try:
        os.unlink(marker(run_dir, os.getpid()))
    except OSError:
        pass


def arm(run_dir: str) -> None:
    """Wrap the agent's current SIGTERM handler (torch's, registered at each worker start) so that
    it first writes the marker. Main thread only; a no-op elsewhere."""
    prev = signal.getsignal(signal.SIGTERM)
    if getattr(prev, "_dtorch_marks", False):
        return
    path = marker(run_dir, os.getpid())

    def handler(signum: int, frame: Any) -> None:
        try:
            with open(path, "w") as f:
                f.write(f"{signal.Signals(signum).name}\n")
        except OSError:
            pass
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    handler._dtorch_marks = True  # type: ignore[attr-defined]
    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:
        pass


def agent_preempting() -> bool:
    """In a worker: whether its agent was told to stop from outside (see module doc). The launcher
    also names the marker in DTORCH_PREEMPT_MARKER, which is what `dtorch.train.preempt` reads."""
    env = current()
    return bool(env.run_dir and env.agent_pid and os.path.exists(marker(env.run_dir, env.agent_pid)))
