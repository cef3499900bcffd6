"""A worker killed mid-step between durable checkpoints costs one step: the group restores the
in-memory snapshot of the step before, and every loss is bit-identical to an uninterrupted run.
Real `dtorch train` at world 2 (DDP; FSDP, TP and PP, where each rank snapshots its own shards or
stage), real SIGKILL."""

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


def _train(tmp_path, name: str, *extra: str, args: list[str] = ARGS) -> list[dict]:
    ckpt, run = tmp_path / name / "ckpt", tmp_path / name / "run"
    p = subprocess.run([*CLI, *args, "--checkpoint-dir", str(ckpt), "--run-dir", str(run), *extra],
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


@pytest.mark.parametrize("plan", ["dp_shard=2", "tp=2", "pp=2"])
def test_sharded_plans_restore_their_own_shards_and_redo_one_step(tmp_path, plan):
    """FSDP and TP snapshot the local shard of every DTensor (parameters and optimizer state) and
    rebuild the same DTensors; PP snapshots each rank's stage. About 15-25 s per plan (two runs)."""
    args = [*ARGS[:ARGS.index("--steps")], "--steps", "10", "--checkpoint-every", "50", "--plan", plan]
    args[args.index("--model") + 1] = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=64"  # two blocks: two stages
    base, _ = _train(tmp_path, "base", args=args)
    drill, evs = _train(tmp_path, "drill", "--chaos", "kill:rank=1:step=6:phase=forward_backward", args=args)
    (fault,) = [e for e in evs if e["kind"] == "fault"]
    restores = [e for e in evs if e["kind"] == "phase" and e.get("name") == "snapshot_restore"]
    assert fault["step"] == 6 and sorted(e["rank"] for e in restores) == [0, 1]
    assert all(e["step"] == 5 and e["durable_step"] == 0 for e in restores), restores
    assert [r["step"] for r in drill] == list(range(1, 11))  # only the interrupted step 6 is redone
    assert {r["step"]: r["loss"] for r in drill} == {r["step"]: r["loss"] for r in base}
