"""Issue 16: with a communication-heavy plan (TP at world 4) the per-rank metrics' exposed
communication share on the tp axis agrees within 25 % with an independent measurement, torch's
profiler over the same steps (dtorch.monitor.commprofile). About 20 s on 2 cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dtorch.monitor.report import read_jsonl

pytestmark = pytest.mark.slow


def test_tp_world4_exposed_comm_share_matches_the_profiler(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "dtorch.cli", "train", "--nproc", "4", "--model",
           "gpt:layers=2,hidden=64,heads=4,vocab=256,seq=64", "--seq-len", "64", "--global-batch", "4",
           "--steps", "6", "--checkpoint-dir", str(run), "--checkpoint-every", "100", "--sample-tokens", "0",
           "--plan", "tp=4", "--metrics-every", "3", "--no-progress", "--max-restarts", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "DTORCH_PROFILE_COMMS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rec = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("event") == "ranks"][-1]
    assert rec["step"] == 6  # the window the profiler covered: steps 4..6
    for r in rec["ranks"]:
        prof = json.loads((run / f"comm-profile-rank{r['rank']}.json").read_text())
        assert (prof["first_step"], prof["last_step"]) == (4, 6)
        share, ref = r["comm_tp"] / r["step"], prof["exposed_s_per_step"] / r["step"]
        assert ref > 0.2, prof  # communication-heavy indeed
        assert abs(share - ref) <= 0.25 * ref, (r["rank"], share, ref)
        # and nothing of it is misattributed to another axis
        others = sum(r[f"comm_{a}"] for a in ("dp_replicate", "dp_shard", "cp", "pp", "other"))
        assert others < 0.05 * r["comm_tp"], r
