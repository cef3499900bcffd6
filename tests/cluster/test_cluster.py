import json

import pytest

from dtorch.cluster import detect, load_cluster, save_cluster
from dtorch.cluster.presets import DEVICES, preset_names
from dtorch.errors import ConfigError


def test_shorthand_counts_nodes_times_devices():
    c = load_cluster("h100:8x8")
    assert (c.num_nodes, c.devices_per_node, c.world_size) == (8, 8, 64)
    assert c.groups[0].device.peak("bfloat16") == 989e12
    assert c.groups[0].inter.bandwidth == 50e9  # NDR 400 Gb/s per NIC, one NIC per GPU


def test_single_node_and_bare_preset_shorthands():
    assert load_cluster("a100:4").world_size == 4
    assert load_cluster("H200").world_size == 8  # a DGX-class node by default


def test_mixed_shorthand_keeps_each_group_and_plans_with_the_slowest():
    c = load_cluster("h100:4x8+a100:2x8")
    assert [g.num_nodes for g in c.groups] == [4, 2]
    assert c.world_size == 48 and not c.homogeneous
    assert c.slowest_group().device.name.startswith("A100")


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_has_positive_spec_numbers(name):
    dev = DEVICES[name]
    assert dev.peak("bfloat16") > 0 and dev.memory_bytes > 0 and dev.memory_bandwidth > 0
    assert load_cluster(f"{name}:2x1").world_size == 2


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_cluster_file_round_trips(tmp_path, suffix):
    c = load_cluster("h100:2x8+mi300x:1x8")
    c.calibration = {"matmul_efficiency": 0.7}
    path = tmp_path / f"c{suffix}"
    save_cluster(c, path)
    back = load_cluster(str(path))
    assert back.groups == c.groups
    assert back.calibration == c.calibration
    assert load_cluster(str(path)).world_size == 24


def test_short_cluster_file_fills_preset_defaults(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("groups:\n  - device: h100\n    num_nodes: 3\n    inter: {bandwidth: 2.5e+10}\n")
    c = load_cluster(str(path))
    assert c.world_size == 24 and c.name == "mine"
    assert c.groups[0].inter.bandwidth == 25e9 and c.groups[0].inter.kind == "ib"


@pytest.mark.parametrize(
    "doc, field",
    [
        ({"groups": [{"device": "h100", "num_nodes": "many"}]}, "groups[0].num_nodes"),
        ({"groups": [{"device": "h100", "num_nodes": -1}]}, "groups[0].num_nodes"),
        ({"groups": [{"device": "v100"}]}, "groups[0].device"),
        ({"groups": [{"device": "h100", "intra": {"bandwidth": 0}}]}, "groups[0].intra.bandwidth"),
        ({"groups": [{"device": "h100", "inter": {"kind": "pigeon"}}]}, "groups[0].inter.kind"),
        ({"groups": [{"device": "h100", "gpus": 8}]}, "groups[0].gpus"),
        ({"groups": [{"device": {"name": "X", "peak_flops": {"bfloat16": 1e15}}}]}, "groups[0].device.memory_bytes"),
        ({"groups": []}, "groups"),
        ({"nodes": 3, "groups": [{"device": "h100"}]}, "nodes"),
    ],
)
def test_malformed_cluster_file_names_the_field(tmp_path, doc, field):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError) as err:
        load_cluster(str(path))
    assert err.value.field == field


def test_unparseable_yaml_is_a_config_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("groups: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid yaml"):
        load_cluster(str(path))


@pytest.mark.parametrize("spec", ["v100:8x8", "h100:0x8", "h100:8x8x8", ""])
def test_bad_shorthand_names_the_cluster_field(spec):
    with pytest.raises(ConfigError) as err:
        load_cluster(spec)
    assert err.value.field == "cluster"


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="h100-sxm"):
        load_cluster("tpu:4x4")


def test_detect_describes_this_machine():
    c = detect()
    g = c.groups[0]
    assert c.world_size >= 1 and g.device.memory_bytes > 0 and g.device.peak("float32") > 0
    if g.device.kind == "cpu":
        assert g.devices_per_node == 1 and g.host_memory_bytes > 0
