"""The NVMe offload tier under `dtorch train --nproc 2` keeps its in-memory snapshots: a worker
SIGKILLed mid-step restores the snapshot of the step before (the optimizer's moments read from
its block files into shared memory, written back into the restarted worker's files) and every
loss is bit-identical to an uninterrupted run. Real `dtorch train`, real SIGKILL; about 15-20 s
(two 2-worker runs of 10 steps), with the harness of tests/elastic/test_snapshot_recovery.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "elastic"))
from test_snapshot_recovery import ARGS, _train  # noqa: E402

pytestmark = [pytest.mark.slow]


def test_disk_tier_run_killed_after_a_snapshot_recovers_from_it_bit_identically(tmp_path):
    args = [*ARGS[:ARGS.index("--steps")], "--steps", "10", "--checkpoint-every", "50", "--plan", "dp_replicate=2"]
    runs = {}
    for name, extra in (("base", []), ("drill", ["--chaos", "kill:rank=1:step=6:phase=forward_backward"])):
        tier = tmp_path / f"{name}-tier"
        tier.mkdir()
        runs[name] = _train(tmp_path, name, "--offload", "optimizer_nvme", "--offload-dir", str(tier), *extra,
                            args=args)
    (base, _), (drill, evs) = runs["base"], runs["drill"]
    (fault,) = [e for e in evs if e["kind"] == "fault"]
    restores = [e for e in evs if e["kind"] == "phase" and e.get("name") == "snapshot_restore"]
    assert fault["step"] == 6 and sorted(e["rank"] for e in restores) == [0, 1], restores
    # restored from the snapshot of step 5 (before the fix snapshots were off and the drill
    # resumed from scratch: no durable checkpoint exists before step 50)
    assert all(e["step"] == 5 and e["durable_step"] == 0 for e in restores), restores
    assert [r["step"] for r in drill] == list(range(1, 11))  # only the interrupted step 6 is redone
    assert {r["step"]: r["loss"] for r in drill} == {r["step"]: r["loss"] for r in base}
