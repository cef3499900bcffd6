"""Chaos drills: fault injection driven by `dtorch run --chaos SPEC` or `DTORCH_CHAOS=SPEC`.

A worker (the trainer, or any script) calls `maybe_inject(step, phase)` at the points where a fault
may strike, for example at the start of each step and before each collective:

    chaos.maybe_inject(step, "forward")
    ...
    chaos.maybe_inject(step, "allreduce")

SPEC is one or more faults separated by `;`. A fault is a kind followed by `key=value` fields,
joined by `:`:

    kill:rank=1:step=5               SIGKILL rank 1 at the first injection point of step >= 5
    kill:rank=1:phase=allreduce:step=5   ... only at the `allreduce` point
    hang:rank=2:step=7               SIGSTOP rank 2 at step 7 (mode=busy: spin in Python instead)
    slow:rank=0:factor=3             rank 0 runs 3x slower from step 0 (or from step=K): the time
                                     between two injection points is stretched by sleeping
    killnode:rank=1:step=5           SIGKILL rank 1's agent, then rank 1: its whole node is lost
                                     (the agent's other workers die with it)
    every=20:kill                    every 20 steps (20, 40, ...) SIGKILL one rank drawn with a seeded
                                     generator (seed=S, default 0); `every=20:hang` likewise

`rank=*` (or no rank) means any rank: the first one to reach the point. A kill or hang fires once
per run: before firing, the worker creates `<run_dir>/chaos/<fault>` with O_EXCL, so a restarted
worker (or another rank) never fires the same fault again. Use a fresh run directory (or
`--rdzv-id`) for a new drill. Every fired fault is logged as a `fault` event with its time, which
the recovery report uses as the start of the `detect` phase.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass, field

from dtorch.env import current
from dtorch.errors import ConfigError

KINDS = ("kill", "killnode", "hang", "slow")
_FIELDS = {"rank", "step", "phase", "factor", "mode", "seed", "every"}


@dataclass(frozen=True)
class Fault:
    """One fault of a drill. `rank` None means any rank; `every` > 0 makes it periodic."""

    kind: str
    rank: int | None = None
    step: int = 0
    phase: str | None = None
    factor: float = 1.0
    mode: str = "stop"
    every: int = 0
    seed: int = 0
    text: str = field(default="", compare=False)

    def key(self, step: int) -> str:
        """File name that marks this fault (this occurrence, if periodic) as fired."""
        base = self.text.replace("/", "_").replace(":", "_").replace("=", "-").replace("*", "any")
        return f"{base}@{step}" if self.every else base

    def victim(self, step: int, world_size: int) -> int | None:
        """The rank a periodic fault strikes at `step` (same on every rank: seeded by step)."""
        if not self.every:
            return self.rank
        return random.Random(self.seed * 1_000_003 + step).randrange(world_size)


def parse(spec: str) -> list[Fault]:
    """Parse a chaos SPEC (see the module docstring). Raises ConfigError naming the bad part."""
    faults = []
    for text in (p.strip() for p in spec.split(";")):
        if not text:
            continue
        kind, kv = None, {}
        for part in text.split(":"):
            if "=" in part:
                k, v = part.split("=", 1)
                if k not in _FIELDS:
                    raise ConfigError("chaos", text, f"unknown field {k!r}; use {sorted(_FIELDS)}")
                kv[k] = v
            elif part in KINDS and kind is None:
                kind = part
            else:
                raise ConfigError("chaos", text, f"unknown part {part!r}; a fault is "
                                  "KIND[:rank=R][:step=K][:phase=P] with KIND in {kill, killnode, hang, slow}, "
                                  "or every=N:KIND")
        if kind is None:
            raise ConfigError("chaos", text, "name the fault kind: kill, killnode, hang or slow")
        try:
            f = Fault(kind=kind,
                      rank=None if kv.get("rank", "*") == "*" else int(kv["rank"]),
                      step=int(kv.get("step", 0)), phase=kv.get("phase"),
                      factor=float(kv.get("factor", 3.0 if kind == "slow" else 1.0)),
                      mode=kv.get("mode", "stop"), every=int(kv.get("every", 0)),
                      seed=int(kv.get("seed", 0)), text=text)
        except ValueError as e:
            raise ConfigError("chaos", text, f"a number is malformed ({e})") from None
        if f.mode not in ("stop", "busy"):
            raise ConfigError("chaos", text, "hang mode is 'stop' (SIGSTOP) or 'busy' (spin)")
        if f.every < 0 or f.factor < 1.0:
            raise ConfigError("chaos", text, "every must be > 0 and factor >= 1")
        faults.append(f)
    return faults


class Injector:
    """The faults of this worker. Cheap when nothing matches (a few comparisons per call)."""

    def __init__(self, faults: list[Fault], rank: int, world_size: int, run_dir: str | None):
        self.faults, self.rank, self.world_size, self.run_dir = faults, rank, world_size, run_dir
        self._last_t: float | None = None

    def maybe_inject(self, step: int, phase: str = "step") -> None:
        now = time.perf_counter()
        for f in self.faults:
            if f.kind == "slow":
                if (f.rank is None or f.rank == self.rank) and step >= f.step and self._last_t is not None:
                    time.sleep((f.factor - 1.0) * (now - self._last_t))
                continue
            if f.phase is not None and f.phase != phase:
                continue
            if f.every:
                if step <= 0 or step % f.every or f.victim(step, self.world_size) != self.rank:
                    continue
            elif step < f.step or (f.rank is not None and f.rank != self.rank):
                continue
            if self._claim(f, step):
                self._fire(f, step, phase)
        self._last_t = time.perf_counter()

    def _claim(self, f: Fault, step: int) -> bool:
        """Atomically mark `f` fired; False if it fired before (in this run, on any rank)."""
        if self.run_dir is None:
            return True
        d = os.path.join(self.run_dir, "chaos")
        os.makedirs(d, exist_ok=True)
        try:
            fd = os.open(os.path.join(d, f.key(step)), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            json.dump({"fault": f.text, "rank": self.rank, "step": step, "t": time.time()}, fh)
        return True

    def _fire(self, f: Fault, step: int, phase: str) -> None:
        from dtorch.elastic import events, heartbeat

        events.log("fault", fault=f.text, fault_kind=f.kind, rank=self.rank, step=step, phase=phase)
        heartbeat.flush()  # so the monitor's record shows this step and phase, not the previous beat
        agent = current().agent_pid
        if f.kind == "killnode" and agent:
            os.kill(agent, signal.SIGKILL)  # its workers die with it
        if f.kind in ("kill", "killnode"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            while True:  # a busy hang: the heartbeat thread still runs, progress does not
                pass


_injector: Injector | None = None


def injector() -> Injector:
    """This worker's injector, built once from DTORCH_CHAOS, RANK, WORLD_SIZE, DTORCH_RUN_DIR."""
    global _injector
    if _injector is None:
        env = current()
        _injector = Injector(parse(env.chaos), env.rank or 0, env.world_size or 1, env.run_dir)
    return _injector


def maybe_inject(step: int, phase: str = "step") -> None:
    """Fire any fault of this run's chaos spec that matches this rank, `step` and `phase`.

    A no-op (one list check) when no spec is set."""
    inj = injector()
    if inj.faults:
        inj.maybe_inject(step, phase)
