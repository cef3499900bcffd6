"""Preemption: a scheduler's warning signal becomes a checkpoint and an exit that requeues.

Slurm sends SIGUSR1 (`#SBATCH --signal=USR1@GRACE`, `scancel --signal=USR1`) or SIGTERM (a
preemption, then SIGKILL after KillWait); Kubernetes sends SIGTERM and kills after the pod's
terminationGracePeriodSeconds. The handler only sets a flag; the trainer asks `requested()` after
every step, all ranks agree on it with one small all-reduce run in the background during the next
step (a signal reaches the ranks at slightly different times, but they must stop after the same
step), write a synchronous checkpoint and exit with `EXIT_PREEMPTED`. The batch script / pod restart policy then requeues the job and it
resumes from that checkpoint.

Under `dtorch run`, SIGUSR1 of a worker is the hang detector's stack-dump signal, so only
SIGTERM is taken there, and only when the agent was itself told to stop
(`dtorch.elastic.preemption`); a SIGTERM of a restart (a peer failed) still ends the worker at once.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from dtorch import env

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later"


class Preemption:
    def __init__(self, world: int, device: Any = "cpu", run_env: env.RuntimeEnv | None = None):
        self.world = world
        self.device = device
        self.env = run_env if run_env is not None else env.current()
        self.signal: str | None = None
        self._pending: Any = None
        self._old: dict[int, Any] = {}
        sigs = [signal.SIGTERM, signal.SIGUSR2]
        if not self.env.run_dir:
            sigs.append(signal.SIGUSR1)
        for s in sigs:
            try:
                self._old[s] = signal.signal(s, self._on_signal)
            except ValueError:  # not the main thread: the caller keeps default signal handling
                pass

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM and self.env.run_dir:
            # the launcher names its preemption marker (`dtorch.elastic.preemption`) in the
            # environment: the trainer reads the file, and imports nothing of the launcher
            mark = self.env.preempt_marker
            if not (mark and os.path.exists(mark)):
                # the agent is restarting the group (a peer failed): stop at once, as before
                old = self._old.get(signum, signal.SIG_DFL)
                if callable(old):
                    old(signum, frame)
                    return
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
        if self.signal is None:
            self.signal = signal.Signals(signum).name

    def requested(self) -> bool:
        """Whether any rank was signalled (collective when world > 1: call on every rank after
        every step). The ranks' flags are reduced in the background while the next step runs, so
        the answer reflects the signals seen up to the previous call: one step of delay, no wait."""
        if self.world <= 1:
            return self.signal is not None
        import torch
        import torch.distributed as dist

        seen = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            self._pending = None
            seen = bool(flag.item())
        if seen:
            if self.signal is None:
                self.signal = "peer"
            return True
        flag = torch.tensor([1 if self.signal is not None else 0], dtype=torch.int32, device=self.device)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        return False

    def close(self) -> None:
        if self._pending is not None:  # every rank issued it: completes on every rank
            try:
                self._pending[0].wait()
            except Exception:  # the group is gone (a peer died): nothing to finish
                pass
            self._pending = None
        for s, old in self._old.items():
            try:
                signal.signal(s, old)
            except (ValueError, TypeError):
                pass
        self._old.clear()
