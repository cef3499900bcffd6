"""Out-of-memory errors that explain themselves, and a restart that does not repeat them.

When a step runs out of memory on any rank, the trainer (`Trainer.fit`) catches it, and this
module names it: rank, phase (forward_backward, optimizer, checkpoint), pipeline stage(s), the
memory measured by category (CUDA: allocated, reserved, peak, the failed request, the device
total; CPU: resident set now and at peak, and before the first step) against the planner's
estimate (`plan.predicted["memory_breakdown"]`). The record goes to `<log_dir>/oom.jsonl` (each
rank appends its own line), to the elastic event log as an ``oom`` event, and to the console; then
the error is raised again, so the worker fails and the launcher restarts the group.

The restarted trainer reads `oom.jsonl` (`memory_budget`) and plans again with a memory budget
per rank that the failed plan does not fit: the failed plan's predicted memory times the share of
what it needed that was there (`available / needed`, over the memory the plan controls: what it
used above the process's baseline before the first step). Two OOMs compound. A plan given by the
user as a Plan object or file is not re-planned (it is the user's choice); its OOM is still named.

Testing on CPU. Linux has no catchable CPU out-of-memory error: the kernel's OOM killer sends
SIGKILL. So the tests set a cap with ``DTORCH_TEST_MEMORY_CAP="rank=R,over_base=BYTES[,from_step=N]"``:
on rank R, after forward/backward of step N or later (default 1; later lets a checkpoint be
written first), a peak resident set above (baseline + BYTES) is treated as an out-of-memory error
(raised as `torch.OutOfMemoryError`). The peak is the kernel's own high-water
mark of the process (VmHWM, reset before the first step), so the cap bites on real memory use,
but the error is raised by DTorch, after the fact, not by a failed allocation.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import torch

OOM_FILE = "oom.jsonl"
CAP_ENV = "DTORCH_TEST_MEMORY_CAP"


def _status(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak() -> None:
    """Reset the kernel's peak-RSS mark of this process (Linux; elsewhere a no-op)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgG]i?[bB]?)?\s*", text)
    if not m:
        from dtorch.errors import ConfigError

        raise ConfigError(CAP_ENV, text, "give bytes like 80000000, 80MB or 1.5GiB")
    scale = {"k": 2**10, "m": 2**20, "g": 2**30}.get((m.group(2) or " ")[0].lower(), 1)
    return int(float(m.group(1)) * scale)


class MemoryCap:
    """The test-only cap (see module docstring); `check()` raises when the peak is over it."""

    def __init__(self, rank: int, base_bytes: int):
        self.limit: int | None = None
        self.from_step = 1
        spec = os.environ.get(CAP_ENV)
        if not spec:
            return
        fields = dict(kv.split("=", 1) for kv in spec.split(",") if "=" in kv)
        if int(fields.get("rank", "0")) != rank:
            return
        self.limit = base_bytes + _bytes(fields.get("over_base", "0"))
        self.from_step = int(fields.get("from_step", "1"))

    def check(self, step: int) -> None:
        """Raise torch.OutOfMemoryError when `step` (1-based) is capped and the peak is over the cap."""
        if self.limit is None or step < self.from_step:
            return
        peak = _status("VmHWM") or 0
        if peak > self.limit:
            raise torch.OutOfMemoryError(
                f"peak resident set {peak / 2**20:,.0f} MiB is over the memory cap of {self.limit / 2**20:,.0f} MiB "
                f"set for this test ({CAP_ENV})")


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    msg = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


def describe(exc: BaseException, *, rank: int, phase: str, step: int, stages: list[int], plan: Any,
             device: torch.device, base_bytes: int, cap: MemoryCap | None = None) -> dict[str, Any]:
    """The ``oom`` record: who, where, how much by category, against the estimate, and the ratio
    of available to needed memory the next plan must respect."""
    pred = (getattr(plan, "predicted", None) or {})
    rec: dict[str, Any] = {"rank": rank, "phase": phase, "step": step, "stages": stages,
                           "plan": plan.describe() if plan is not None else None,
                           "world_size": getattr(plan, "world_size", None),
                           "error": str(exc).splitlines()[0][:400] if str(exc) else type(exc).__name__,
                           "estimate_bytes": pred.get("memory_bytes_per_rank"),
                           "estimate_by_category": pred.get("memory_breakdown")}
    if device.type == "cuda":
        m = re.search(r"Tried to allocate ([0-9.]+ [KMG]iB)", str(exc))
        requested = _bytes(m.group(1).replace(" ", "")) if m else 0
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        measured = {"allocated": allocated, "reserved": torch.cuda.memory_reserved(device),
                    "peak_allocated": torch.cuda.max_memory_allocated(device), "requested": requested,
                    "device_total": total, "device_free": free}
        # what this process could have had: the free device memory plus what its allocator holds
        needed, available = allocated + requested, free + torch.cuda.memory_reserved(device)
        base = 0
    else:
        peak = _status("VmHWM") or 0
        measured = {"rss": _status("VmRSS") or 0, "peak_rss": peak, "rss_before_first_step": base_bytes}
        if cap is not None and cap.limit is not None:
            measured["cap"] = cap.limit
        needed, available, base = peak, (cap.limit if cap is not None and cap.limit else peak), base_bytes
    rec["measured"] = measured
    rec["needed_bytes"], rec["available_bytes"] = int(needed), int(available)
    # the share of the plan-controlled memory (above the baseline) that was there
    ratio = max(0.05, min(0.95, (available - base) / max(needed - base, 1)))
    rec["budget_ratio"] = ratio
    est = rec["estimate_bytes"]
    if est:
        # The estimate's fixed margin (runtime, allocator) is no plan's doing; the rest is what the
        # plan controls. Measured over estimated for that part is how far off the planner was, so
        # the next plan's controlled estimate must fit what was available divided by that, with a
        # 10 % safety margin.
        margin = float((rec["estimate_by_category"] or {}).get("margin", 0))
        controlled = max(est - margin, 1.0)
        scale = max(1.0, (needed - base) / controlled)
        rec["estimate_scale"] = scale
        rec["budget_bytes"] = int(margin + 0.9 * max(available - base, 0) / scale)
    rec["t"] = time.time()
    return rec


def record(rec: dict[str, Any], log_dir: str | os.PathLike | None) -> None:
    """Append to <log_dir>/oom.jsonl and the elastic event log (one write each, O_APPEND)."""
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        fd = os.open(Path(log_dir, OOM_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(rec, default=str) + "\n").encode())
        finally:
            os.close(fd)
    from dtorch import eventlog

    eventlog.log("oom", **{k: v for k, v in rec.items() if k != "t"})


def message(rec: dict[str, Any]) -> str:
    est = rec.get("estimate_bytes")
    m = rec["measured"]
    used = m.get("peak_rss", m.get("allocated", 0))
    return (f"dtorch: OUT OF MEMORY on rank {rec['rank']} in {rec['phase']} at step {rec['step']} "
            f"(stage {','.join(map(str, rec['stages'])) or '-'}, plan {rec['plan']}): "
            f"{used / 2**20:,.0f} MiB used, {rec['needed_bytes'] / 2**20:,.0f} MiB needed, "
            f"{rec['available_bytes'] / 2**20:,.0f} MiB available; the plan estimated "
            f"{(est or 0) / 2**20:,.1f} MiB per rank; the next start re-plans within "
            f"{rec.get('budget_bytes', 0) / 2**20:,.1f} MiB (estimated).")


def read(log_dir: str | os.PathLike | None) -> list[dict[str, Any]]:
    if log_dir is None:
        return []
    from dtorch.monitor.report import read_jsonl

    return read_jsonl(Path(log_dir, OOM_FILE))


def memory_budget(log_dir: str | os.PathLike | None, world_size: int) -> tuple[int | None, list[str]]:
    """(bytes per rank the next plan's estimate must stay under, the plans that ran out of memory)
    from the OOMs recorded for this world size; (None, []) when there were none."""
    budget = None
    failed = []
    for rec in read(log_dir):
        if rec.get("world_size") != world_size or not rec.get("budget_bytes"):
            continue
        b = int(rec["budget_bytes"])
        budget = b if budget is None else min(budget, b)
        failed.append(rec["plan"])
    return budget, failed
