"""Calibration hygiene: runtime feedback is written only from clean runs and into the job's own
directory; the shared calibration (what `dtorch plan` reads) changes only when asked; `dtorch plan`
names the calibration it used."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from dtorch.cluster.calibration_store import (
    CALIBRATION_VERSION,
    adopt_feedback,
    calibration_path,
    describe_calibration,
    read_calibration,
    with_stored_calibration,
    write_calibration,
)
from dtorch.cluster.load import load_cluster
from dtorch.errors import ConfigError
from dtorch.monitor import feedback
from dtorch.plan.plan import Plan

CLI = [sys.executable, "-m", "dtorch.cli"]
TINY = ["--model", "gpt:layers=1,hidden=32,heads=2,vocab=256,seq=64", "--seq-len", "32", "--sample-tokens", "0",
        "--global-batch", "4"]
CLUSTER = "local:1x2"


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def shared(tmp_path, monkeypatch):
    """A shared calibration for local:1x2 in a private calibration directory; returns its path."""
    cal = tmp_path / "cal"
    monkeypatch.setenv("DTORCH_CALIBRATION_DIR", str(cal))
    for k in ("DTORCH_NO_CALIBRATION", "DTORCH_CHAOS", "TORCHELASTIC_RESTART_COUNT", "DTORCH_EPOCH"):
        monkeypatch.delenv(k, raising=False)
    return write_calibration({"version": CALIBRATION_VERSION, "cluster": CLUSTER, "device": {}, "links": {},
                              "feedback": {"compute_scale": 1.0, "memory_scale": 1.0, "samples": 1}},
                             calibration_path(CLUSTER))


def _plan() -> Plan:
    return Plan(dp_shard=2, predicted={"step_time_s": 0.01, "memory_bytes_per_rank": 1e6})


def test_a_run_with_a_reason_writes_nowhere_and_says_why(shared, tmp_path, monkeypatch):
    before = _sha(shared)
    monkeypatch.setenv("DTORCH_CHAOS", "kill:rank=1:step=4")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    reasons = feedback.unclean_reasons(stragglers=2)
    assert len(reasons) == 3 and "chaos" in reasons[0] and "restart" in reasons[1] and "straggler" in reasons[2]
    job = tmp_path / "job" / "calibration.json"
    out = feedback.record(_plan(), 0.03, None, CLUSTER, path=job, unclean=reasons)
    assert out["path"] is None and "chaos" in out["not_written"] and out["time_ratio"] == pytest.approx(3.0)
    assert not job.exists() and _sha(shared) == before


def test_a_clean_run_writes_its_own_file_from_the_shared_start_and_leaves_the_shared_one(shared, tmp_path):
    before = _sha(shared)
    assert feedback.unclean_reasons() == []
    job = tmp_path / "job" / "calibration.json"
    feedback.record(_plan(), 0.02, None, CLUSTER, path=job, alpha=1.0)
    second = feedback.record(_plan(), 0.02, None, CLUSTER, path=job, alpha=1.0)
    assert second["path"] == str(job) and _sha(shared) == before
    fb = read_calibration(job)["feedback"]
    assert fb["samples"] == 3 and len(fb["history"]) == 2  # the shared 1 sample, then this job's two
    # adopting it is the explicit step that moves the shared calibration, and the next plans
    adopt_feedback(job, CLUSTER)
    assert read_calibration(shared)["feedback"] == fb
    with pytest.raises(ConfigError):
        adopt_feedback(shared.parent / "missing.json", CLUSTER)


def test_plan_names_the_stored_calibration_or_none(shared, tmp_path):
    from dtorch.cluster.spec import Cluster

    c = with_stored_calibration(load_cluster("cpu:1x2"), CLUSTER)
    assert describe_calibration(c) == f"calibration: {shared}, runtime feedback of 1 run(s)"
    assert describe_calibration(Cluster(load_cluster("cpu:1x2").groups, name="x")).startswith("calibration: none")
    p = subprocess.run([*CLI, "plan", "--model", "llama-tiny", "--cluster", "cpu:1x2", "--seq-len", "128"],
                       capture_output=True, text=True, timeout=120, env={**os.environ})
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1].startswith("calibration: none (preset or detected figures")


def _train(tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([*CLI, "train", "--nproc", "2", *TINY, "--checkpoint-dir", str(ckpt), "--steps", "10",
                        "--run-dir", str(tmp_path / "run"), *extra],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    with open(ckpt / "metrics.jsonl") as f:
        events = [json.loads(x) for x in f if '"feedback"' in x]
    return p, events


@pytest.mark.slow
def test_a_chaos_drill_leaves_the_shared_calibration_unchanged_by_hash(shared, tmp_path):
    before = _sha(shared)
    p, fb = _train(tmp_path, "--chaos", "kill:rank=1:step=4")
    assert p.returncode == 0, p.stderr[-2000:]
    assert fb and "chaos drill" in fb[-1]["not_written"] and fb[-1]["path"] is None
    assert _sha(shared) == before
    assert not (tmp_path / "ckpt" / "calibration.json").exists()


@pytest.mark.slow
def test_a_clean_training_run_feeds_back_into_its_own_directory_only(shared, tmp_path):
    before = _sha(shared)
    p, fb = _train(tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    job = tmp_path / "ckpt" / "calibration.json"
    assert fb and fb[-1]["path"] == str(job) and "not_written" not in fb[-1]
    assert read_calibration(job)["feedback"]["samples"] == 2
    assert _sha(shared) == before
