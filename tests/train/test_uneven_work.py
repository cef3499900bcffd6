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

    assert list(BATCH.limits(Plan(dp_shard=2, num_microbatches=2, dp_shares=[3, 1]))) == []
    assert list(BATCH.limits(Plan(dp_replicate=2, pp=2, num_microbatches=3, dp_shares=[4, 2]))) == []
    (lim,) = BATCH.limits(Plan(dp_shard=2, num_microbatches=2, dp_shares=[3, 1], ep=2))
    assert "expert" in lim.why
    (lim,) = BATCH.limits(Plan(dp_replicate=2, pp=2, schedule="1f1b", num_microbatches=2, dp_shares=[3, 1]))
    assert "share >= 2" in lim.fix
    assert list(BATCH.limits(Plan(dp_replicate=2, pp=2, schedule="gpipe", num_microbatches=2, dp_shares=[3, 1]))) == []
