"""A worker killed mid-step between durable checkpoints costs one step: the group restores the
in-memory snapshot of the step before, and every loss is bit-identical to an uninterrupted run.
Real `dtorch train` at world 2 (DDP), real SIGKILL."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dtorch.elastic import events

pytestmark = [pytest.mark.slow]

CLI = [sys.executable, "-c", "import sys; from dtorch.cli import main; sys.exit(main())", "train"]
ARGS = ["--nproc", "2", "--model", "gpt:layers=1,hidden=32,heads=2,vocab=256,seq=64", "--seq-len", "32",
        "--sample-tokens", "0", "--no-progress", "--steps", "30", "--checkpoint-every", "50", "--plan", "dp_replicate=2"]


def _train(tmp_path, name: str, *extra: str) -> list[dict]:
    ckpt, run = tmp_path / name / "ckpt", tmp_path / name / "run"
    p = subprocess.run([*CLI, *ARGS, "--checkpoint-dir", str(ckpt), "--run-dir", str(run), *extra],
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    with open(ckpt / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "loss" in r], events.read(str(run / events.EVENTS_FILE))


def test_kill_between_durable_checkpoints_redoes_one_step_bit_identically(tmp_path):
    base, _ = _train(tmp_path, "base")
    drill, evs = _train(tmp_path, "drill", "--chaos", "kill:rank=1:step=23:phase=forward_backward")
    (fault,) = [e for e in evs if e["kind"] == "fault"]
    (restore,) = [e for e in evs if e["kind"] == "phase" and e.get("name") == "snapshot_restore" and e["rank"] == 0]
    assert fault["step"] == 23 and restore["step"] == 22 and restore["durable_step"] == 0
    steps = [r["step"] for r in drill]
    assert steps == list(range(1, 31)), steps  # step 23 was interrupted before it ended: only it is redone
    assert {r["step"]: r["loss"] for r in drill} == {r["step"]: r["loss"] for r in base}
