"""Runtime feedback: the stored correction moves toward the measurement, and the next estimate
for that cluster with it."""

from __future__ import annotations

import pytest

from dtorch.cluster import local_cluster
from dtorch.cluster.probe import CALIBRATION_VERSION, calibration_path, read_calibration, write_calibration
from dtorch.errors import ConfigError
from dtorch.monitor import feedback
from dtorch.plan.cost import estimate
from dtorch.plan.plan import Plan
from dtorch.plan.profiles import get_profile


@pytest.fixture
def cal_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DTORCH_CALIBRATION_DIR", str(tmp_path))
    monkeypatch.delenv("DTORCH_NO_CALIBRATION", raising=False)
    write_calibration({"version": CALIBRATION_VERSION, "cluster": "local:1x2", "device_kind": "cpu",
                       "device": {"peak_flops": {"float32": 2e10}, "matmul_efficiency": 0.5, "memory_bandwidth": 5e9},
                       "links": {"intra": {"kind": "shm", "bandwidth": 1e9, "latency": 1e-4}}},
                      calibration_path("local:1x2"))
    return tmp_path


def _predicted_plan():
    prof = get_profile("llama-tiny", 128)
    plan = Plan(dp_shard=2, microbatch_size=4, param_dtype="float32")
    est = estimate(plan, prof, local_cluster(2), "float32")
    plan.predicted = {"step_time_s": est.step_time_s, "memory_bytes_per_rank": est.memory_bytes_per_rank,
                      "time_breakdown": est.time_breakdown}
    return plan, prof, est


def test_feedback_ema_moves_the_next_prediction_toward_the_measured_step_time(cal_dir):
    plan, prof, est = _predicted_plan()
    measured = 3.0 * est.step_time_s
    gaps = []
    for _ in range(6):
        out = feedback.record(plan, measured, int(est.memory_bytes_per_rank * 1.5), "local:1x2", alpha=0.5)
        new = estimate(plan, prof, local_cluster(2), "float32")
        gaps.append(abs(new.step_time_s - measured) / measured)
        plan.predicted.update(step_time_s=new.step_time_s, time_breakdown=new.time_breakdown)
    assert out["compute_scale"] < 1.0  # slower than predicted: the efficiency is lowered
    assert gaps == sorted(gaps, reverse=True) and gaps[-1] < 0.05 < gaps[0]
    doc = read_calibration(calibration_path("local:1x2"))
    assert doc["feedback"]["samples"] == 6 and len(doc["feedback"]["history"]) == 6
    assert doc["links"]["intra"]["bandwidth"] == 1e9  # the probe's numbers are kept


def test_memory_above_prediction_lowers_the_capacity_the_planner_budgets(cal_dir):
    plan, _, est = _predicted_plan()
    cap0 = local_cluster(2).groups[0].device.memory_bytes
    out = feedback.record(plan, est.step_time_s, 2 * est.memory_bytes_per_rank, "local:1x2", alpha=1.0)
    assert out["memory_ratio"] == pytest.approx(2.0) and out["memory_scale"] == pytest.approx(2.0)
    assert local_cluster(2).groups[0].device.memory_bytes == pytest.approx(cap0 / 2, rel=1e-6)
    # a prediction that was right leaves the compute correction where it was
    assert out["compute_scale"] == pytest.approx(1.0)


def test_feedback_without_prediction_stores_nothing_and_bad_input_names_the_field(cal_dir, tmp_path):
    assert "skipped" in feedback.record(Plan(), 1.0, None, "local:9x9")
    assert not calibration_path("local:9x9").exists()
    with pytest.raises(ConfigError, match="measured_step_time_s"):
        feedback.record(Plan(predicted={"step_time_s": 1.0}), -1.0, None, "local:1x2")


def test_feedback_creates_a_calibration_for_an_unprobed_cluster(cal_dir):
    plan, _, est = _predicted_plan()
    out = feedback.record(plan, est.step_time_s * 2, None, "local:1x3")
    assert calibration_path("local:1x3").is_file() and out["path"] == str(calibration_path("local:1x3"))
    assert out["compute_scale"] < 1.0
