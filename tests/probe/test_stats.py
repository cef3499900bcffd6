"""Statistics helpers of the benchmarks on hand-computed cases."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root holds benchmarks/

from benchmarks.stats import mape, ranks, regret, spearman  # noqa: E402


def test_ranks_average_ties():
    assert ranks([10, 30, 20, 20]) == [1.0, 4.0, 2.5, 2.5]


def test_spearman_on_hand_cases():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # one swapped pair of 4: 1 - 6*sum(d^2)/(n(n^2-1)) = 1 - 6*2/60 = 0.8
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


def test_mape_on_hand_case():
    assert mape([110, 90, 50], [100, 100, 100]) == pytest.approx((0.1 + 0.1 + 0.5) / 3)


def test_regret_is_the_measured_time_of_the_predicted_best_over_the_best_measured():
    assert regret([1.0, 2.0, 3.0], [1.2, 1.0, 2.0]) == pytest.approx(1.2)
    assert regret([3.0, 2.0, 1.0], [3.0, 2.0, 1.0]) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        regret([], [])


def test_nonnegative_least_squares_recovers_costs_and_drops_a_column_that_would_go_negative():
    from benchmarks.bench_sweep import _lstsq_nonneg

    X = [[1.0, n, c, 1.0] for n, c in ((100, 2), (400, 5), (900, 40), (1600, 7), (2500, 90))]
    y = [0.5 * a + 2e-4 * n + 3e-3 * c + 0.1 for a, n, c, _ in X]
    coef = _lstsq_nonneg(X, y)
    assert coef[1] == pytest.approx(2e-4, rel=1e-6) and coef[2] == pytest.approx(3e-3, rel=1e-6)
    # a feature that only hurts the fit gets 0, not a negative cost
    y2 = [1.0 - 1e-4 * n for _, n, _, _ in X]
    assert all(c >= 0 for c in _lstsq_nonneg([[n, 1.0] for _, n, _, _ in X], y2))


def test_mean_tree_averages_numbers_leaf_by_leaf_and_keeps_the_rest():
    from benchmarks.stats import mean_tree

    a = {"cluster": "local:1x2", "bw": 2.0, "ok": True, "gemm": [{"rows": 128, "flops": 1.0}], "only_a": 5,
         "rounds": [1.0, 2.0]}
    b = {"cluster": "other", "bw": 4.0, "ok": False, "gemm": [{"rows": 128, "flops": 3.0}], "rounds": [1.0]}
    assert mean_tree(a, b) == {"cluster": "local:1x2", "bw": 3.0, "ok": True, "gemm": [{"rows": 128.0, "flops": 2.0}],
                               "only_a": 5, "rounds": [1.0, 2.0]}


def test_repetition_spread_is_the_slowest_repetition_over_the_fastest():
    from benchmarks.bench_sweep import repetition_spread

    rows = [{"measured_rep_medians_s": [1.0, 1.5, 1.2]}, {"measured_rep_medians_s": [2.0, 2.0]},
            {"measured_rep_medians_s": [1.0, 3.0]}, {"measured_rep_medians_s": [4.0]}, {"measured_rep_medians_s": []}]
    assert repetition_spread(rows) == {"median": 1.5, "p90": 3.0}
    assert repetition_spread(rows[3:]) is None


def test_rescore_drops_a_dotted_calibration_field_and_leaves_the_rest():
    from benchmarks.bench_sweep import without

    cal = {"attention": [1], "links": {"intra": {"latency": 1e-4, "sync_skew": [[1e-3, 1e-4]]}}}
    assert without(cal, ["attention"]) == {"links": cal["links"]}
    assert without(cal, ["links", "intra", "sync_skew"]) == {"attention": [1], "links": {"intra": {"latency": 1e-4}}}
    assert without(cal, ["links", "inter", "sync_skew"]) == cal  # absent: unchanged
    assert "sync_skew" in cal["links"]["intra"]  # a copy: the stored calibration is not touched
