"""Uneven work across data-parallel ranks (docs/heterogeneous.md): the sampler's cut of the global
batch by shares, the straggler response's shares, and the executor's limits. Pure, milliseconds."""

from __future__ import annotations

import pytest

from dtorch.errors import ConfigError
from dtorch.plan.plan import Plan
from dtorch.train.rebalance import dp_speeds, rebalanced_shares, shares_from_speeds
from dtorch.train.sampler import GlobalSampler


def test_shares_cut_the_same_global_batch_contiguously_whatever_the_split():
    s = GlobalSampler(num_samples=50, global_batch=12, seed=3)
    for step in (0, 4, 9):  # 9: the batch straddles an epoch boundary
        whole = s.global_indices(step)
        for shares in ([9, 3], [1, 11], [6, 6], [2, 4, 6]):
            parts = [s.local_indices(step, r, len(shares), shares=shares) for r in range(len(shares))]
            assert [len(p) for p in parts] == shares
            assert sum(parts, []) == whole
        # even shares are exactly the even split
        assert [s.local_indices(step, r, 2, shares=[6, 6]) for r in (0, 1)] == [s.local_indices(step, r, 2)
                                                                               for r in (0, 1)]


@pytest.mark.parametrize("shares,says", [([6, 5], "sum to global_batch=12"), ([12, 0], "positive"),
                                         ([4, 4, 4], "give 2")])
def test_bad_sample_shares_name_the_fix(shares, says):
    with pytest.raises(ConfigError, match=says):
        GlobalSampler(50, 12).local_indices(0, 0, 2, shares=shares)


def test_shares_from_speeds_are_proportional_keep_the_total_and_give_everyone_one():
    assert shares_from_speeds([2.0, 1.0], 24) == [16, 8]
    assert shares_from_speeds([1.0, 1.0, 1.0], 7) in ([3, 2, 2], [2, 3, 2], [2, 2, 3])
    assert shares_from_speeds([1000.0, 1.0], 4) == [3, 1]
    with pytest.raises(ConfigError, match="at least one micro-batch"):
        shares_from_speeds([1.0, 1.0, 1.0], 2)


def test_rebalance_takes_each_data_parallel_group_at_its_slowest_rank():
    # 4 ranks: dp groups {0, 1} and {2, 3} (TP pairs); rank 3 runs 2x slower than the rest
    ratio = [1.0, 1.05, 1.0, 2.0]
    assert dp_speeds(ratio, [0, 0, 1, 1], 2) == pytest.approx([1 / 1.05, 0.5])
    assert rebalanced_shares(None, 3, ratio, [0, 0, 1, 1], 2) == [4, 2]
    assert rebalanced_shares([4, 2], 3, ratio, [0, 0, 1, 1], 2) is None  # already there
    assert rebalanced_shares(None, 3, [1.0, 2.0], [0, 0], 1) is None  # one data-parallel rank


def test_uneven_shares_run_except_where_the_executor_cannot_and_it_says_why():
    from dtorch.plan.strategies.batch import BATCH

    assert list(BATCH.limits(Plan(dp_shard=2, num_microbatches=2, dp_shares=[3, 1], reshard_after_forward=False))) == []
    (lim,) = BATCH.limits(Plan(dp_shard=2, num_microbatches=2, dp_shares=[3, 1]))  # FSDP must keep them gathered
    assert lim.field == "reshard_after_forward" and "reshard_after_forward=false" in lim.fix
    assert list(BATCH.limits(Plan(dp_replicate=2, pp=2, num_microbatches=3, dp_shares=[4, 2]))) == []
    (lim,) = BATCH.limits(Plan(dp_shard=2, num_microbatches=2, dp_shares=[3, 1], ep=2, reshard_after_forward=False))
    assert "expert" in lim.why
    (lim,) = BATCH.limits(Plan(dp_replicate=2, pp=2, schedule="1f1b", num_microbatches=2, dp_shares=[3, 1]))
    assert "share >= 2" in lim.fix
    assert list(BATCH.limits(Plan(dp_replicate=2, pp=2, schedule="gpipe", num_microbatches=2, dp_shares=[3, 1]))) == []


def _slow_rank_worker(case, rank):
    import time

    from dtorch.models import build_model
    from dtorch.train.trainer import Trainer

    tr = Trainer(model=lambda: build_model("llama-tiny"), plan=Plan(dp_replicate=2, microbatch_size=1,
                 num_microbatches=4), global_batch=8, seq_len=16, checkpoint_dir=case, checkpoint_every=4,
                 straggler_every=1, rebalance=True, console=False, async_checkpoint=False, metrics_every=0)
    setup = tr._setup

    def slowed(steps):  # the test's slow device: rank 1's blocks take 10 ms longer (test code, not DTorch's)
        setup(steps)
        if rank == 1:
            for m in tr.parallel.blocks():
                m.register_forward_hook(lambda *a: time.sleep(0.01))

    tr._setup = slowed
    res = tr.fit(6)
    return {"steps": sorted(res.losses), "shares": tr.plan.dp_shares}


@pytest.mark.slow
def test_a_persistently_slow_rank_gets_fewer_micro_batches_from_the_next_checkpoint(tmp_path):
    """2 gloo ranks, 6 steps (about 6 s on a quiet machine): the straggler check names rank 1 by step 3, the shares are
    re-cut by measured speed at the step-4 checkpoint (logged), and the run finishes under them;
    the checkpoint records the plan the run goes on with."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
    from _harness import run_group

    (r0, r1), = run_group(2, [str(tmp_path)], _slow_rank_worker)
    assert "error" not in r0 and "error" not in r1, r0.get("error") or r1.get("error")
    assert r0["steps"] == list(range(1, 7)) and r0["shares"] == r1["shares"]
    fast, slow = r0["shares"]
    assert fast + slow == 8 and fast > slow
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    applied = [e for e in events if e.get("event") == "rebalance" and "applied" in e]
    assert [(e["step"], e["applied"]) for e in applied] == [(4, [fast, slow])]
    from dtorch.checkpoint import CheckpointManager

    plans = {i.step: i.plan.get("dp_shares") for i in CheckpointManager(tmp_path).list() if i.plan}
    assert plans[6] == [fast, slow]
