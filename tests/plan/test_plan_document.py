import json

import pytest

from dtorch.errors import ConfigError
from dtorch.plan.plan import Plan


def test_plan_round_trips_through_json(tmp_path):
    plan = Plan(dp_shard=4, tp=2, microbatch_size=2, num_microbatches=4, ac="selective", global_batch=32)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert json.loads(path.read_text())["version"] == 1


def test_plan_round_trips_through_yaml(tmp_path):
    plan = Plan(pp=2, num_microbatches=4, schedule="interleaved_1f1b", virtual_stages=2)
    path = tmp_path / "plan.yaml"
    plan.save(path)
    assert Plan.load(path) == plan


@pytest.mark.parametrize(
    "fields, field_name",
    [
        ({"tp": 0}, "tp"),
        ({"ac": "some"}, "ac"),
        ({"sp": True}, "sp"),
        ({"pp": 4, "num_microbatches": 2}, "num_microbatches"),
        ({"pp": 2, "num_microbatches": 2, "layer_partition": [3]}, "layer_partition"),
        ({"dp_shard": 2, "global_batch": 3}, "global_batch"),
    ],
)
def test_invalid_plan_names_the_field(fields, field_name):
    with pytest.raises(ConfigError) as err:
        Plan(**fields).validate()
    assert err.value.field == field_name


def test_world_size_mismatch_is_rejected():
    with pytest.raises(ConfigError, match="world size is 8"):
        Plan(dp_shard=2, tp=2).validate(world_size=8)


def test_unknown_field_in_file_is_rejected(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"version": 1, "tensor_parallel": 2}))
    with pytest.raises(ConfigError, match="unknown plan field"):
        Plan.load(path)
