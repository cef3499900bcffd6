"""Out-of-memory errors that explain themselves, and a restart that does not repeat them.

When a step runs out of memory on any rank, the trainer (`Trainer.fit`) catches it, and this
module names it: rank, phase (forward_backward, optimizer, checkpoint), pipeline stage(s), the
memory measured by category (CUDA: allocated, reserved, peak, the failed request, the device
total; CPU: resident set now and at peak, and before the first step) against the planner's
estimate (`plan.predicted["memory_breakdown"]`). The record goes to `<log_dir>/oom.jsonl` (each
rank appends its own line), to the elastic event log as an ``oom`` event, and to the console; then
the error is raised again, so the worker fails and the launcher restarts the group.

The restarted trainer reads `oom.jsonl` (`Replan.load`) and plans again. Each record measured how
far the estimate of the plan-controlled memory (all but the fixed margin) was below what the plan
grew by above the process's baseline: a scale and an offset for that plan family. The search
judges every candidate by its corrected estimate, max(scale * c, c + offset) for its family (a
family not measured yet: the worst seen), against the margin plus 90 % of the memory that was
available; a family that ran out twice is excluded; when nothing fits, one ConfigError names the
rank, the bytes and the fix (no restart would meet anything else). A plan given by the user as a
Plan object or file is not re-planned (it is the user's choice); its OOM is still named.

Testing on CPU. Linux has no catchable CPU out-of-memory error: the kernel's OOM killer sends
SIGKILL. So the tests set a cap with ``DTORCH_TEST_MEMORY_CAP="rank=R,over_base=BYTES[,from_step=N]"``:
on rank R, after forward/backward of step N or later (and after a checkpoint save) (default 1; later lets a checkpoint be
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dtorch.env import current
from dtorch.monitor.jsonl import read_jsonl

OOM_FILE = "oom.jsonl"
CAP_ENV = "DTORCH_TEST_MEMORY_CAP"
SAFETY = 0.9
"""The share of the memory an OOM found available that the next plan may plan to use."""
MAX_OOMS_PER_FAMILY = 2
"""A family that ran out of memory this often at one world size, corrected each time, is excluded."""


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
        spec = current().memory_cap
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
    rec["family"] = plan.family() if plan is not None else None
    est = rec["estimate_bytes"]
    if est:
        # The estimate's margin (runtime, allocator) is no plan's doing; the rest is what the plan
        # controls (less a correction an earlier OOM added: the raw estimate is what is compared).
        # What it grew by above the baseline over that estimate is how far off the planner was for
        # this plan family (`Replan` applies it to the family's candidates); the room is what was
        # there for the plan-controlled memory.
        cats = rec["estimate_by_category"] or {}
        margin = float(cats.get("margin", 0))
        controlled = max(est - margin - float(cats.get("correction", 0)), 1.0)
        grown, room = max(needed - base, 0), max(available - base, 0)
        rec["controlled_estimate_bytes"], rec["controlled_measured_bytes"] = int(controlled), int(grown)
        rec["room_bytes"] = int(room)
        rec["estimate_scale"] = max(1.0, grown / controlled)
        rec["estimate_offset_bytes"] = int(max(0.0, grown - controlled))
        # what the next plan's (corrected) estimate must stay under: the margin plus 90 % of the room
        rec["budget_bytes"] = int(margin + SAFETY * room)
    rec["t"] = time.time()
    return rec


def record(rec: dict[str, Any], log_dir: str | os.PathLike | None) -> None:
    """Append to <log_dir>/oom.jsonl and the elastic event log (one write each, O_APPEND)."""
    from dtorch import eventlog

    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        # private, never through a planted link, dropped (not raised) on a full disk
        eventlog.append_line(Path(log_dir, OOM_FILE), (json.dumps(rec, default=str) + "\n").encode(), "oom")
    eventlog.log("oom", **{k: v for k, v in rec.items() if k != "t"})


def message(rec: dict[str, Any]) -> str:
    est = rec.get("estimate_bytes")
    m = rec["measured"]
    used = m.get("peak_rss", m.get("allocated", 0))
    measured = ""
    if "estimate_scale" in rec:
        measured = (f"; the plan-controlled memory grew by {rec['controlled_measured_bytes'] / 2**20:,.1f} MiB against "
                    f"{rec['controlled_estimate_bytes'] / 2**20:,.1f} MiB estimated (x{rec['estimate_scale']:.2f}), "
                    f"{rec['room_bytes'] / 2**20:,.1f} MiB was there")
    return (f"dtorch: OUT OF MEMORY on rank {rec['rank']} in {rec['phase']} at step {rec['step']} "
            f"(stage {','.join(map(str, rec['stages'])) or '-'}, plan {rec['plan']}): "
            f"{used / 2**20:,.0f} MiB used, {rec['needed_bytes'] / 2**20:,.0f} MiB needed, "
            f"{rec['available_bytes'] / 2**20:,.0f} MiB available; the plan estimated "
            f"{(est or 0) / 2**20:,.1f} MiB per rank{measured}; the next start re-plans within "
            f"{rec.get('budget_bytes', 0) / 2**20:,.1f} MiB (estimated), its {rec.get('family')} plans' estimates "
            f"corrected by that measurement.")


def read(log_dir: str | os.PathLike | None) -> list[dict[str, Any]]:
    if log_dir is None:
        return []
    return read_jsonl(Path(log_dir, OOM_FILE))


def memory_budget(log_dir: str | os.PathLike | None, world_size: int) -> tuple[int | None, list[str]]:
    """(bytes per rank the next plan's estimate must stay under, the plans that ran out of memory)
    from the OOMs recorded for this world size; (None, []) when there were none."""
    r = Replan.load(log_dir, world_size)
    return (r.budget, r.failed) if r is not None else (None, [])


@dataclass
class Replan:
    """What the OOMs recorded at one world size say about the next plan.

    `budget`: the bytes per rank a plan's corrected estimate must stay under (the lowest of the
    records': the margin plus 90 % of the memory that was available to the plan). `corrections`:
    per plan family, (scale, offset) measured over estimated plan-controlled memory, the largest
    seen; `correct()` applies them. A family not measured gets the largest scale and offset seen
    in any family (the estimate ran low on this machine; assume no better until measured). A family
    that ran out of memory `MAX_OOMS_PER_FAMILY` times is excluded. `records`: the OOMs, oldest first."""

    budget: int | None
    failed: list[str]
    records: list[dict[str, Any]]
    corrections: dict[str, tuple[float, int]] = field(default_factory=dict)
    excluded: set[str] = field(default_factory=set)
    margin: float = 0.0

    @classmethod
    def load(cls, log_dir: str | os.PathLike | None, world_size: int) -> Replan | None:
        recs = [r for r in read(log_dir) if r.get("world_size") == world_size and r.get("budget_bytes")]
        if not recs:
            return None
        low = min(recs, key=lambda r: int(r["budget_bytes"]))
        out = cls(budget=int(low["budget_bytes"]), failed=[r.get("plan") for r in recs], records=recs,
                  margin=float(low["budget_bytes"]) - SAFETY * float(low["room_bytes"]) if "room_bytes" in low else 0.0)
        count: dict[str, int] = {}
        for r in recs:
            fam = r.get("family")
            if fam is None or "estimate_scale" not in r:
                continue  # a record of an older DTorch: its budget still holds
            s0, o0 = out.corrections.get(fam, (1.0, 0))
            out.corrections[fam] = (max(s0, float(r["estimate_scale"])), max(o0, int(r.get("estimate_offset_bytes", 0))))
            count[fam] = count.get(fam, 0) + 1
        out.excluded = {f for f, n in count.items() if n >= MAX_OOMS_PER_FAMILY}
        return out

    def correction(self, family: str) -> tuple[float, int]:
        """(scale, offset) for a family's plan-controlled estimate: its own, else the worst seen."""
        if family in self.corrections:
            return self.corrections[family]
        if not self.corrections:
            return 1.0, 0
        return (max(s for s, _ in self.corrections.values()), max(o for _, o in self.corrections.values()))

    def correct(self, plan: Any, est: Any) -> int:
        """The search's `memory_correction`: the bytes per rank `plan` is judged by. Its plan-
        controlled estimate c becomes max(scale * c, c + offset) -- through the measured point, an
        upper bound of any error a * c + b with a >= 1 and b >= 0 (bigger plans by the scale,
        smaller ones by the offset) -- on the budget's margin, so that it fits when that is under
        90 % of the memory that was there; a family excluded after repeated OOMs never fits."""
        fam = plan.family()
        if fam in self.excluded:
            return 2**62
        cats = est.memory_breakdown or {}
        c = max(est.memory_bytes_per_rank - float(cats.get("margin", 0)), 0.0)
        scale, offset = self.correction(fam)
        return int(max(self.margin, float(cats.get("margin", 0))) + max(scale * c, c + offset))

    def describe(self) -> str:
        """One line: the budget, the corrections and the exclusions (for the console and errors)."""
        corr = ", ".join(f"{f} x{s:.2f} / +{o / 2**20:,.0f} MiB" for f, (s, o) in sorted(self.corrections.items()))
        return (f"within {self.budget / 2**20:,.1f} MiB/rank (estimated)"
                + (f", estimates corrected by the measured memory per plan family ({corr}; other families get "
                   f"the largest)" if corr else "")
                + (f", excluded after {MAX_OOMS_PER_FAMILY} OOMs: {', '.join(sorted(self.excluded))}"
                   if self.excluded else ""))

    def nothing_fits(self, closest: tuple[Any, Any] | None) -> str:
        """The fix when no plan fits under the budget: which rank ran out, by how much, what to change."""
        worst = max(self.records, key=lambda r: int(r.get("needed_bytes", 0)) - int(r.get("available_bytes", 0)))
        near = ""
        if closest is not None:
            p, e = closest
            near = (f"; the leanest plan ({p.describe()}) would need {e.memory_bytes_per_rank / 2**20:,.1f} MiB "
                    f"(corrected estimate)")
        return (f"{len(self.records)} out-of-memory error(s) at this world size, the last on rank "
                f"{self.records[-1].get('rank')} ({self.records[-1].get('plan')}); the worst on rank {worst.get('rank')} "
                f"needed {int(worst.get('needed_bytes', 0)) / 2**20:,.0f} MiB with {int(worst.get('available_bytes', 0)) / 2**20:,.0f} "
                f"MiB available; no plan fits {self.describe()}{near}. Fix: more memory per rank (more devices "
                f"or processes with more memory), a smaller model, a shorter sequence or a smaller global batch; "
                f"or delete oom.jsonl in the log directory to plan without the measured corrections")
