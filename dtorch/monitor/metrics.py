"""Per-step training metrics: loss, gradient norm, tokens/s, MFU, step time, peak memory.

One `MetricsLogger` per process. Every rank measures; rank 0 writes the JSONL log, draws the console
progress line and hands every record to its `sinks` (the live page's state, TensorBoard and W&B:
`dtorch.train.callbacks.TensorBoard` / `WandB`). Units: seconds, tokens/s, bytes.

`metrics.jsonl` is private (0600) and never appended through a planted link (refused with a
ConfigError); on a full disk a line that cannot be written is dropped with one warning, so that the
job ends on the error that stopped it (a checkpoint's, naming the bytes it needs), not on its log.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch


def peak_memory_bytes(device: torch.device | None = None) -> int:
    """Peak memory of this process: CUDA allocator peak on GPU, else the resident-set high-water mark."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


@dataclass
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    tokens_per_s: float
    mfu: float
    peak_memory_bytes: int
    world_size: int
    epoch: int = 0
    """Membership epoch (elastic restarts) the step ran in."""


class MetricsLogger:
    """Writes StepMetrics as JSON lines (rank 0), a console progress line, and hands each record to
    its sinks."""

    def __init__(self, log_dir: str | Path | None, *, rank: int = 0, total_steps: int | None = None,
                 console: bool = True):
        self.rank = rank
        self.total_steps = total_steps
        self.console = console and rank == 0
        self._jsonl: int | None = None
        self._jsonl_path: Path | None = None
        self._t0 = time.perf_counter()
        self.sinks: list = []
        """Callables given every record written (rank 0): the live monitor's state, TensorBoard, W&B."""
        self.note = ""
        """Appended to the console line (the per-rank view's slowest rank)."""
        self._ema_step: float | None = None
        self.log_dir = Path(log_dir) if log_dir is not None and rank == 0 else None
        if log_dir is not None and rank == 0:
            from dtorch import eventlog, trust

            path = Path(log_dir)
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._jsonl_path = path / "metrics.jsonl"
            self._jsonl = trust.open_append(self._jsonl_path, "metrics")  # closed in close()
            eventlog.reserve(path)
            if eventlog.events_path() is not None:  # under `dtorch run`: where `dtorch report` finds failures
                self.event("events_log", path=eventlog.events_path())

    @property
    def path(self) -> Path | None:
        """The JSONL log (rank 0 with a log_dir), else None."""
        return self._jsonl_path

    def log(self, m: StepMetrics) -> None:
        if self.rank != 0:
            return
        record = {**asdict(m), "t": time.time()}  # wall time: the page places events between steps by it
        self._write(json.dumps(record))
        for sink in self.sinks:
            sink(record)
        # ETA from a moving average of the step time (the first steps are slow, old ones stale)
        self._ema_step = m.step_time_s if self._ema_step is None else 0.9 * self._ema_step + 0.1 * m.step_time_s
        tty = sys.stderr.isatty()
        # a log file gets ~30 progress lines per run, a terminal one line redrawn in place
        every = max(1, (self.total_steps or 0) // 30)
        if self.console and (tty or m.step % every == 0 or m.step == self.total_steps):
            total = f"/{self.total_steps}" if self.total_steps else ""
            width = 24
            frac = (m.step / self.total_steps) if self.total_steps else 0.0
            bar = "#" * int(width * frac) + "-" * (width - int(width * frac))
            line = (f"\r[{bar}] step {m.step}{total} loss {m.loss:.4f} gnorm {m.grad_norm:.3f} "
                    f"{m.tokens_per_s:,.0f} tok/s mfu {m.mfu * 100:.1f}% {m.step_time_s * 1e3:.0f} ms "
                    f"mem {m.peak_memory_bytes / 2**20:,.0f} MiB")
            if self.total_steps and m.step < self.total_steps:
                line += f" ETA {format_eta((self.total_steps - m.step) * self._ema_step)}"
            if self.note:
                line += f" {self.note}"
            end = "\n" if (not tty or m.step == self.total_steps) else ""
            print(line if tty else line.lstrip("\r"), end=end, file=sys.stderr, flush=True)

    def event(self, kind: str, **fields: Any) -> None:
        """A non-step record (plan chosen, checkpoint saved, resume, recovery) in the same JSONL log."""
        if self.rank != 0:
            return
        record = {"event": kind, "time_s": round(time.perf_counter() - self._t0, 6), "t": time.time(), **fields}
        self._write(json.dumps(record, default=str))
        for sink in self.sinks:
            sink(record)

    def _write(self, text: str) -> None:
        if self._jsonl is not None:
            from dtorch import eventlog

            eventlog.append_line(self._jsonl_path, (text + "\n").encode(), "metrics", fd=self._jsonl)  # type: ignore[arg-type]

    def close(self) -> None:
        if self._jsonl is not None:
            os.close(self._jsonl)
            self._jsonl = None


def format_eta(seconds: float) -> str:
    """'42s', '3m05s', '2h07m'."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def measured_gemm_rate(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024) -> float:
    """Achieved FLOP/s of an n x n x n matmul on `device`: what a GEMM reaches here, for comparison
    (`benchmarks/bench_mfu.py`). Not MFU's denominator: a measured rate is no peak (MFU against it
    read 91-104 % on a CPU); that is `dtorch.cluster.peak`'s."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    reps = 5
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - t)
