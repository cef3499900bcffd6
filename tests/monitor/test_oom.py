"""A forced OOM on one rank of a 2-worker run: named in oom.jsonl and the event log, the restart
re-plans under the measured budget with each plan family's estimate corrected by what was measured,
and finishes; the checkpoint before the OOM is intact.

On CPU the OOM is provoked by a test-only cap (DTORCH_TEST_MEMORY_CAP, see dtorch/monitor/oom.py):
rank 1's peak resident set above its pre-step baseline + 100 MiB counts as out of memory from
step 3 on. The first plan (DDP, no activation checkpointing) grows by ~131 MiB (estimated 134 MiB
until 2026-12-05, 90 MiB since DDP's buckets are counted as gradient-sized, not as a fixed 50 MiB)
and goes over. Measured 2026-12-01 (load 8-16, 4 runs, identical to 1 MiB): the re-plan without
a measurement of FSDP tried FSDP without AC (81 MiB estimated), which grew by 107 MiB at step 5
while the async save of step 4 was written (x1.32 / +26 MiB for FSDP); the next re-plan, FSDP with
selective AC corrected by that, finished. A CI run (2026-12-04) saw 4: FSDP with selective AC
grew by 108 MiB and was excluded with its family, then a pipeline plan grew by 107 MiB. Before the per-family correction and the fixed glibc mmap
threshold the same drill saw 1-4 OOMs (the peak of one plan moved by 25 MiB between runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.drill]


def test_forced_oom_is_named_and_the_replanned_restart_finishes(tmp_path):
    from dtorch.checkpoint import CheckpointManager
    from dtorch.monitor.report import read_jsonl

    ckpt = tmp_path / "ckpt"
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dtorch.cli", "run", "--nproc-per-node", "2", "--max-restarts", "5",
           "--run-dir", str(run_dir), "-m", "dtorch.train.job",
           "--model", "gpt:layers=4,hidden=128,heads=4,vocab=256,seq=256", "--seq-len", "256",
           "--global-batch", "16", "--steps", "5", "--checkpoint-every", "2", "--checkpoint-dir", str(ckpt),
           "--sample-tokens", "0", "--no-progress", "--metrics-every", "0",
           # float32, as the cap was sized for: the precision the search picks depends on this CPU's
           # measured bf16 speed, and bf16 activations under autocast on a CPU are not half the RSS
           "--plan", "param_dtype=float32"]
    # its own calibration: the runtime feedback earlier tests of the suite wrote would change the plans
    # MALLOC_MMAP_THRESHOLD_: glibc returns a freed tensor's memory to the kernel instead of keeping
    # it in its heap (by default the threshold rises with the largest block freed, and what stays
    # resident then depends on which thread freed what when: +-25 MiB of peak between runs of one
    # plan under load). The capped peak is then the live memory's, as a GPU allocator counts it.
    env = {**os.environ, "DTORCH_TEST_MEMORY_CAP": "rank=1,over_base=100MB,from_step=3",
           "MALLOC_MMAP_THRESHOLD_": "131072", "DTORCH_CALIBRATION_DIR": str(tmp_path / "calibration")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    ooms = read_jsonl(ckpt / "oom.jsonl")
    assert len(ooms) >= 1, out.stderr[-3000:]
    first = ooms[0]
    assert first["rank"] == 1 and first["phase"] == "forward_backward" and first["step"] == 3
    assert first["stages"] == [0] and first["estimate_bytes"] > 0 and first["estimate_by_category"]
    assert first["measured"]["peak_rss"] > first["measured"]["cap"] and 0 < first["budget_ratio"] < 1
    assert "OUT OF MEMORY on rank 1 in forward_backward at step 3" in out.stderr
    # every OOM measured its family's error, no plan ran out twice, and the re-planning converged
    # well inside the restarts: a family is corrected by its own OOM and excluded after two
    from dtorch.monitor.oom import MAX_OOMS_PER_FAMILY, SAFETY, Replan

    # the count is the machine's (allocator, threads, load): the CI VM saw 4 where this one sees 2-3;
    # what the design promises is that the re-planning finishes inside the 5 restarts it was given
    assert len(ooms) < 5, [(r["plan"], r["controlled_measured_bytes"]) for r in ooms]
    assert len({r["plan"] for r in ooms}) == len(ooms)
    for r in ooms:
        assert r["family"] and r["estimate_scale"] >= 1 and r["room_bytes"] == 100 * 2**20
        assert r["controlled_measured_bytes"] > r["room_bytes"] and r["estimate_offset_bytes"] >= 0
        assert sum(q["family"] == r["family"] for q in ooms) <= MAX_OOMS_PER_FAMILY
    assert "corrected by the measured memory per plan family" in out.stdout + out.stderr
    events = read_jsonl(run_dir / "events.jsonl")
    assert any(e["kind"] == "oom" and e.get("rank") == 1 for e in events)
    records = read_jsonl(ckpt / "metrics.jsonl")
    plans = [r for r in records if r.get("event") == "plan"]
    assert len(plans) >= 2 and plans[-1]["plan"] != first["plan"]
    # the plan that ran out, its estimate corrected by what it measured, is over the budget; the last is under
    corrected = first["estimate_by_category"]["margin"] + first["estimate_scale"] * first["controlled_estimate_bytes"]
    assert plans[-1]["predicted_memory_bytes_per_rank"] <= first["budget_bytes"] < corrected
    replan = Replan.load(ckpt, 2)
    assert replan.budget == min(r["budget_bytes"] for r in ooms)
    last = plans[-1]
    assert last["plan"] not in replan.failed and last["predicted_memory_bytes_per_rank"] <= replan.budget
    # the finishing plan's own family: its corrected plan-controlled estimate fits 90 % of the room
    cats = last["predicted_memory_breakdown"]
    controlled = last["predicted_memory_bytes_per_rank"] - cats["margin"] - cats.get("correction", 0)
    scale, offset = replan.correction(last["family"])
    assert max(scale * controlled, controlled + offset) <= SAFETY * 100 * 2**20 + 1
    resumes = [r for r in records if r.get("event") == "resume"]
    assert resumes and resumes[0]["step"] == 2
    assert max(r["step"] for r in records if "event" not in r) == 5
    infos = {i.step: i for i in CheckpointManager(ckpt).list()}
    assert infos[2].manifest_ok and infos[5].manifest_ok  # the one before the OOM is intact
    json.dumps(first)
