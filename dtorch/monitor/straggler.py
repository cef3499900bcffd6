"""Straggler detection: which rank makes the others wait.

Each step, every rank measures its *compute time before the collective wait* (from the start of the
step to the moment it enters the gradient all-reduce / reduce-scatter): a slow rank is the one whose
compute is long, while the others' time goes into waiting for it. The times of all ranks are
gathered (one small all_gather) and scored two ways, both robust to noise:

- relative to the fastest rank this step: `t[r] / min(t)`;
- relative to the rank's own history: `(t[r] - median(history[r])) / (1.4826 * MAD(history[r]))`,
  a robust z-score, so a rank that was always a bit slower (another GPU model, a busier host) is
  not flagged, but one that suddenly slows down is.

A rank is a straggler when, for `patience` consecutive steps, it is at least `ratio_threshold`
times slower than the fastest rank, or its robust z-score is above `z_threshold` while it is at
least halfway to that ratio (a sudden slowdown of one rank, before it is extreme). `update()`
returns a report whose `warning()` line names the rank.

`StragglerDetector.update(times)` is pure (no process group): tests and the monitor call it directly;
`gather_compute_times(seconds)` is the one collective a trainer calls each step.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from dtorch.errors import ConfigError


@dataclass(frozen=True)
class StragglerReport:
    """One step's verdict: `ratio[r]` = t[r] / fastest, `zscore[r]` vs the rank's own history
    (None until `min_history` samples), and the ranks flagged this step (`stragglers`)."""

    step: int
    ratio: list[float]
    zscore: list[float | None]
    stragglers: list[int]
    new: list[int]
    """Ranks flagged this step for the first time in their current slow streak (warn once)."""

    def warning(self) -> str | None:
        """One line naming the slow ranks, or None."""
        if not self.stragglers:
            return None
        parts = [f"rank {r} is {self.ratio[r]:.1f}x slower than the fastest rank"
                 + (f" (z={self.zscore[r]:.1f} vs its own history)" if self.zscore[r] is not None else "")
                 for r in self.stragglers]
        return f"dtorch: STRAGGLER at step {self.step}: " + "; ".join(parts)


class StragglerDetector:
    """Scores per-rank compute times step by step (see module docstring).

    ratio_threshold: how many times slower than the fastest rank counts as slow (default 1.5).
    z_threshold: robust z-score above which slowness is "new" for this rank (default 4).
    window: history length per rank (steps). min_history: samples before z-scores are used.
    patience: consecutive slow steps before a rank is named (one slow step is noise).
    min_gap: seconds behind the fastest rank below which nothing is flagged (timer noise on
    millisecond steps would otherwise make every rank a "straggler" now and then).
    """

    def __init__(self, world_size: int, ratio_threshold: float = 1.5, z_threshold: float = 4.0,
                 window: int = 50, min_history: int = 5, patience: int = 3, min_gap: float = 0.01):
        if world_size < 1:
            raise ConfigError("world_size", world_size, "use 1 or more ranks")
        if ratio_threshold <= 1.0:
            raise ConfigError("ratio_threshold", ratio_threshold, "use a ratio > 1, e.g. 1.5")
        self.world_size, self.ratio_threshold, self.z_threshold = world_size, ratio_threshold, z_threshold
        self.min_history, self.patience, self.min_gap = min_history, patience, min_gap
        self.history: list[deque[float]] = [deque(maxlen=window) for _ in range(world_size)]
        self.slow_streak = [0] * world_size
        self.step = 0

    def _z(self, r: int, t: float) -> float | None:
        h = self.history[r]
        if len(h) < self.min_history:
            return None
        med = statistics.median(h)
        mad = statistics.median(abs(x - med) for x in h)
        # Floor the spread at 1% of the median: perfectly steady ranks would otherwise turn any
        # jitter into an infinite z-score.
        return (t - med) / max(1.4826 * mad, 0.01 * med, 1e-9)

    def update(self, times: Sequence[float], step: int | None = None) -> StragglerReport:
        """Score one step's compute times (seconds, one per rank) and remember them. `step` labels
        the report (default: a count of updates)."""
        if step is not None:
            self.step = step
        if len(times) != self.world_size:
            raise ConfigError("times", len(times), f"give one time per rank ({self.world_size})")
        fastest = max(min(times), 1e-9)
        ratio = [t / fastest for t in times]
        zs = [self._z(r, t) for r, t in enumerate(times)]
        flagged = []
        half = 1.0 + (self.ratio_threshold - 1.0) / 2
        for r in range(self.world_size):
            z = zs[r]
            slow = times[r] - fastest >= self.min_gap and (
                ratio[r] >= self.ratio_threshold or (z is not None and z >= self.z_threshold and ratio[r] >= half))
            self.slow_streak[r] = self.slow_streak[r] + 1 if slow else 0
            if self.slow_streak[r] >= self.patience:
                flagged.append(r)
            self.history[r].append(times[r])
        new = [r for r in flagged if self.slow_streak[r] == self.patience]
        report = StragglerReport(self.step, ratio, zs, flagged, new)
        self.step += 1
        return report


def gather_compute_times(seconds: float, group: object | None = None) -> list[float]:
    """All ranks' compute time for this step (one all_gather of a float; call on every rank)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)  # type: ignore[arg-type]
    # NCCL only moves CUDA tensors; gloo moves CPU ones.
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"  # type: ignore[arg-type]
    mine = torch.tensor([seconds], dtype=torch.float64, device=dev)
    out = [torch.zeros(1, dtype=torch.float64, device=dev) for _ in range(world)]
    dist.all_gather(out, mine, group=group)  # type: ignore[arg-type]
    return [float(t.item()) for t in out]


class StragglerWatch:
    """The trainer's straggler check: times every block's forward on this rank (module hooks on the
    blocks `dtorch.model.structure` finds, as the executor does; the
    FSDP all-gather runs in FSDP's own pre-hook, before ours), and every `every` steps gathers
    all ranks' mean seconds per block call into a `StragglerDetector` (one small all_gather).
    Per block call, so pipeline stages holding different numbers of blocks compare fairly. Under
    tensor parallelism a block's forward includes its TP collectives, so the peers of a slow rank
    wait inside their blocks too and the ratio stays near 1: there only the rank's own-history
    z-score can tell."""

    def __init__(self, model_parts: Sequence[object], world_size: int, every: int = 10, patience: int = 2,
                 ratio_threshold: float = 1.5, min_gap: float = 2e-3, structure: object | None = None):
        if every < 1:
            raise ConfigError("straggler_every", every, "check every 1 or more steps (0 turns the check off)")
        self.every = every
        self.detector = StragglerDetector(world_size, ratio_threshold=ratio_threshold, patience=patience,
                                          min_gap=min_gap, min_history=3)
        self.seconds = 0.0
        self.calls = 0
        self._t0 = 0.0
        self._windows = 0
        self._handles = []
        from dtorch.model.structure import blocks_of

        # the blocks as the executor found them (`structure`, dtorch.model.structure), whatever the
        # model names them; a part without blocks is an error, not a watch that sees nothing
        for block in blocks_of(model_parts, structure):  # type: ignore[arg-type]
            self._handles.append(block.register_forward_pre_hook(self._pre))
            self._handles.append(block.register_forward_hook(self._post))

    def _pre(self, module, args) -> None:
        import time

        self._t0 = time.perf_counter()

    def _post(self, module, args, out) -> None:
        import time

        self.seconds += time.perf_counter() - self._t0
        self.calls += 1

    def step_done(self, step: int) -> StragglerReport | None:
        """Call on every rank after every step; every `every` steps returns the detector's report."""
        if step % self.every:
            return None
        per_call = self.seconds / self.calls if self.calls else 0.0
        self.seconds, self.calls = 0.0, 0
        self._windows += 1
        times = gather_compute_times(per_call)
        if self._windows == 1:
            return None  # the first steps include one-time work (allocator, lazy initialisation)
        return self.detector.update(times, step)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
