"""`dtorch probe`'s measured groups: ranks of one device name that run at different speeds become
groups of their own in the written cluster file (dtorch/cluster/hetero.py). Pure, milliseconds."""

from __future__ import annotations

import pytest

from dtorch.cluster.hetero import class_runs, measured_cluster, speed_classes
from dtorch.cluster.load import load_cluster, parse_shorthand, save_cluster
from dtorch.errors import ConfigError


def test_ranks_more_than_the_threshold_apart_are_separate_classes():
    assert speed_classes([10.0, 9.5, 5.0, 9.8]) == [0, 0, 1, 0]
    assert speed_classes([10.0, 9.0]) == [0, 0]  # 10 % apart: one device
    assert speed_classes([10.0, 9.0], threshold=0.05) == [0, 1]
    assert speed_classes([10.0, 5.0, 2.0]) == [0, 1, 2]
    with pytest.raises(ConfigError, match="speed_threshold"):
        speed_classes([1.0], threshold=1.5)


def test_runs_follow_rank_order_and_split_at_node_boundaries():
    assert class_runs([0, 0, 1, 1], 4) == [(0, 0, 2), (1, 2, 2)]
    assert class_runs([0, 0, 0, 0], 2) == [(0, 0, 2), (0, 2, 2)]


def test_a_slowed_rank_is_written_as_its_own_device_group_and_read_back(tmp_path):
    base = parse_shorthand("h100:1x2")
    peak = base.groups[0].device.peak_flops["bfloat16"]
    cluster = measured_cluster(base, [100.0, 50.0], [80 * 2**30, 40 * 2**30])
    assert [g.num_devices for g in cluster.groups] == [1, 1]
    fast, slow = (g.device for g in cluster.groups)
    assert fast.name != slow.name and slow.name.endswith("-slow")
    # the calibrated peak is the median over ranks (of two: their mean); the slow one runs at half
    assert slow.peak_flops["bfloat16"] == pytest.approx(fast.peak_flops["bfloat16"] / 2)
    assert fast.peak_flops["bfloat16"] == pytest.approx(peak * 100 / 75)
    assert slow.memory_bytes == 40 * 2**30
    path = tmp_path / "measured.yaml"
    save_cluster(cluster, path)
    again = load_cluster(str(path))
    assert [g.device.name for g in again.groups] == [fast.name, slow.name]
    assert not again.homogeneous and again.world_size == 2


def test_ranks_that_measure_alike_stay_one_group():
    base = parse_shorthand("h100:2x4")
    cluster = measured_cluster(base, [100.0, 98.0, 101.0, 99.0] * 2)
    assert len(cluster.groups) == 1 and cluster.groups[0].num_devices == 8
