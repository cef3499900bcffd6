"""Runtime feedback: compare a run's measured step time and memory with the plan's prediction, log
the gap, and refine a calibration so a later plan can start from it.

The trainer calls `record(...)` once, on rank 0, at the end of a run (with the median step time
after warm-up). Where it writes (calibration hygiene):

- only a clean run writes: no chaos drill, no restart or membership change, no straggler flagged
  (`unclean_reasons`); any other run measures something other than the plan, so its gap is logged
  and returned but stored nowhere;
- the trainer writes into the job's own directory (``<log_dir>/calibration.json``, a calibration
  document of the same form), never into the shared calibration that `dtorch plan` reads
  (`dtorch.cluster.calibration_store`): that changes only by `dtorch probe` or by an explicit
  request (`calibration_store.adopt_feedback`, or `record(path=calibration_path(cluster))`).

What is learned (stored under ``feedback``, see `dtorch.cluster.probe`):

- ``compute_scale``: a multiplier of the device's matmul efficiency. The whole gap is attributed to
  compute (the predicted communication, bubble and optimizer times are kept): the multiplier that
  would have made this prediction exact is ``current x compute_pred / (measured - other_pred)``;
  the stored value moves toward it by an exponential moving average in log space (weight `alpha`).
- ``memory_scale``: an EMA (log space) of measured / predicted peak memory per rank. Where it is
  above 1 the planner's memory capacity is lowered by it (`apply_calibration`), so the next plan
  keeps the headroom that this run showed it needs; below 1 it is only reported.

Attributing everything to compute is the simplest correction that moves the next prediction to the
measurement; it does not reorder plans that differ only in communication (the probe's link fits do).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from dtorch.cluster.calibration_store import (
    CALIBRATION_VERSION,
    calibration_path,
    read_calibration,
    stored_calibration,
    write_calibration,
)
from dtorch.env import current
from dtorch.errors import ConfigError
from dtorch.plan.plan import Plan

log = logging.getLogger("dtorch.feedback")
HISTORY = 20
COMPUTE_KEYS = ("compute", "recompute", "host")  # what `compute_scale` speeds up or slows down


def _ema_log(old: float, target: float, alpha: float) -> float:
    return math.exp((1.0 - alpha) * math.log(old) + alpha * math.log(target))


def unclean_reasons(stragglers: int = 0) -> list[str]:
    """Why this run's step times are not the plan's (empty: a clean run). Read from the launch
    (`dtorch run` sets DTORCH_CHAOS for a drill; torchelastic counts restarts, DTorch the
    membership epoch) and from the trainer (`stragglers`: straggler flags it raised)."""
    env = current()
    reasons = []
    if env.chaos:
        reasons.append(f"chaos drill {env.chaos!r}")
    restarts = env.restart_count
    if restarts:
        reasons.append(f"{restarts} restart(s)")
    epoch = env.epoch or 0
    if epoch and not restarts:
        reasons.append(f"membership changed (epoch {epoch})")
    if stragglers:
        reasons.append(f"{stragglers} straggler flag(s)")
    return reasons


def record(
    plan: Plan,
    measured_step_time_s: float,
    measured_peak_bytes: int | None,
    cluster_name: str,
    *,
    alpha: float = 0.5,
    save: bool = True,
    path: str | Path | None = None,
    unclean: list[str] | None = None,
) -> dict[str, Any]:
    """Compare one run with `plan.predicted`, log the gap and (when `save` and the run is clean)
    update a calibration for `cluster_name` (the `Cluster.name` the plan was searched on, e.g.
    ``local:1x4``): the file at `path` (the job's own, e.g. ``<log_dir>/calibration.json``; it
    starts from the shared calibration's feedback when new), or, when `path` is None, the shared
    calibration `dtorch plan` reads - an explicit choice only the caller can make.
    `unclean`: the reasons this run is not clean (`unclean_reasons`); any reason means nothing is
    written, and the result says why under ``not_written``.

    `measured_step_time_s`: seconds per optimizer step (a median over steps after warm-up);
    `measured_peak_bytes`: peak memory of the fullest rank in bytes, or None if unknown.
    Returns the comparison: predicted/measured step time and memory, their ratios, the stored
    ``compute_scale`` / ``memory_scale`` after the update, and the calibration path (None when not
    written). A plan without a prediction returns ``{"skipped": reason}`` and stores nothing."""
    if not 0.0 < alpha <= 1.0:
        raise ConfigError("alpha", alpha, "an EMA weight in (0, 1]")
    if not (isinstance(measured_step_time_s, (int, float)) and measured_step_time_s > 0):
        raise ConfigError("measured_step_time_s", measured_step_time_s, "must be positive seconds per step")
    pred = plan.predicted or {}
    p_time = pred.get("step_time_s")
    if not p_time or p_time <= 0:
        return {"skipped": "the plan has no predicted step time (it was not searched or estimated)"}

    breakdown = pred.get("time_breakdown") or {}
    p_compute = sum(float(breakdown.get(k, 0.0)) for k in COMPUTE_KEYS) if breakdown else float(p_time)
    p_other = max(0.0, float(p_time) - p_compute)
    # the measured compute share: what is left once the other predicted parts are taken out,
    # bounded below so that one noisy step cannot drive the efficiency to infinity
    m_compute = max(measured_step_time_s - p_other, 0.1 * p_compute, 1e-9)
    rel = p_compute / m_compute if p_compute > 0 else float(p_time) / measured_step_time_s

    target = Path(path) if path is not None else calibration_path(cluster_name)
    own = read_calibration(target) if path is not None and target.is_file() else None
    doc = own or stored_calibration(cluster_name) or {
        "version": CALIBRATION_VERSION, "cluster": cluster_name, "device": {}, "links": {},
    }
    fb = dict(doc.get("feedback") or {})
    old_c = float(fb.get("compute_scale", 1.0))
    new_c = _ema_log(old_c, old_c * rel, alpha)
    out: dict[str, Any] = {
        "cluster": cluster_name,
        "plan": plan.describe(),
        "predicted_step_time_s": float(p_time),
        "measured_step_time_s": float(measured_step_time_s),
        "time_ratio": measured_step_time_s / float(p_time),
        "compute_scale": new_c,
    }
    p_mem = pred.get("memory_bytes_per_rank")
    new_m = float(fb.get("memory_scale", 1.0))
    if measured_peak_bytes and p_mem:
        ratio = float(measured_peak_bytes) / float(p_mem)
        new_m = _ema_log(new_m, ratio, alpha)
        out.update(predicted_memory_bytes=int(p_mem), measured_memory_bytes=int(measured_peak_bytes),
                   memory_ratio=ratio)
    out["memory_scale"] = new_m
    log.info("plan %s on %s: step %.4g s measured vs %.4g s predicted (x%.2f); memory %s; "
             "compute_scale %.3g -> %.3g", out["plan"], cluster_name, measured_step_time_s, p_time,
             out["time_ratio"], f"x{out['memory_ratio']:.2f}" if "memory_ratio" in out else "n/a", old_c, new_c)

    fb.update(compute_scale=new_c, memory_scale=new_m, samples=int(fb.get("samples", 0)) + 1)
    hist = list(fb.get("history") or [])
    hist.append({k: out[k] for k in ("plan", "predicted_step_time_s", "measured_step_time_s", "time_ratio")}
                | ({"memory_ratio": out["memory_ratio"]} if "memory_ratio" in out else {}))
    fb["history"] = hist[-HISTORY:]
    doc = {**doc, "feedback": fb}
    if unclean:
        out["not_written"] = "not a clean run: " + ", ".join(unclean)
        log.info("calibration not updated: %s", out["not_written"])
    out["path"] = str(write_calibration(doc, target)) if save and not unclean else None
    return out
