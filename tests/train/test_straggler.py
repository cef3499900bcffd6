"""The trainer names a straggler: a real 2-worker job under `dtorch run` in which one rank's blocks
are slower (a sleep in its first block's forward stands for a slower device), and the same job
without it, which names nobody."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = '''
import os, sys, time
import dtorch
from dtorch.models import build_model

def factory():
    m = build_model("gpt:layers=2,hidden=64,heads=2,vocab=256,seq=32")
    if os.environ.get("RANK") == os.environ.get("SLOW_RANK"):
        block = m.layers["0"]
        inner = block.forward
        def slow_forward(*a, **k):
            time.sleep(0.02)
            return inner(*a, **k)
        block.forward = slow_forward
    return m

dtorch.Trainer(model=factory, global_batch=8, seq_len=32, checkpoint_dir=sys.argv[1], plan={"dp_replicate": 2},
               straggler_every=2, console=False, async_checkpoint=False, checkpoint_every=100).fit(steps=12)
'''


def _run(tmp_path: Path, name: str, slow_rank: str | None) -> tuple[list[dict], str]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    ckpt = tmp_path / name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DTORCH_NO_CALIBRATION": "1", "SLOW_RANK": slow_rank or "none"}
    cmd = [sys.executable, "-m", "dtorch.cli", "run", "--nproc-per-node", "2", "--run-dir", str(tmp_path / f"run-{name}"),
           str(script), str(ckpt)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    events = [json.loads(x) for x in (ckpt / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [e for e in events if e.get("event") == "straggler"], proc.stdout + proc.stderr


@pytest.mark.slow
def test_trainer_names_the_slow_rank_once_and_nobody_in_a_balanced_job(tmp_path):
    found, out = _run(tmp_path, "slow", "1")
    assert [e["ranks"] for e in found] == [[1]], found  # named once, not at every check
    assert found[0]["ratio"][1] > 3 and "STRAGGLER" in out and "rank 1" in out
    # the agent's straggler detector recorded the trainer's report (one place records detections)
    from dtorch.elastic import events

    observed = [e for e in events.read(str(tmp_path / "run-slow" / events.EVENTS_FILE)) if e["kind"] == "observed"]
    assert [(e["cause"], e["ranks"]) for e in observed] == [("straggler", [1])]
    balanced, _ = _run(tmp_path, "balanced", None)
    assert balanced == []
