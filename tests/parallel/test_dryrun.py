"""`verify` (dtorch plan --verify): full-scale sharding on a fake process group, no allocation."""

from __future__ import annotations

import torch.distributed as dist

from dtorch.parallel.dryrun import verify
from dtorch.plan.plan import Plan

GiB = 2**30


def test_llama3_70b_fsdp_x_tp_on_64_ranks_measured_state_matches_estimate_within_3_percent() -> None:
    plan = Plan(dp_shard=8, tp=8, num_microbatches=8)
    r = verify(plan, "llama3-70b", 8192)
    got = r["measured"]["max"]
    # 70.6e9 params / 64 ranks x (4 + 4 + 8) bytes
    assert 16 * GiB < got["total"] < 17 * GiB
    assert got["optimizer"] == 2 * got["params"] == 2 * got["grads"]
    assert abs(r["relative_error"]) < 0.03
    assert not dist.is_initialized()


def test_llama3_70b_pipeline_plan_measures_every_stage_and_matches_estimate_within_3_percent() -> None:
    plan = Plan(pp=2, dp_shard=4, tp=8, schedule="1f1b", num_microbatches=8)
    r = verify(plan, "llama3-70b", 8192)
    ranks = r["measured"]["ranks"]
    assert [x["rank"] for x in ranks] == [0, 32]
    assert [x["stages"] for x in ranks] == [[0], [1]]
    # FSDP2 under a pipeline keeps unsharded gradients until the last micro-batch
    assert all(x["grads_unsharded_accumulation"] > 0 for x in ranks)
    assert abs(r["relative_error"]) < 0.03


def test_more_data_parallel_shards_reduce_measured_bytes_per_rank() -> None:
    small = verify(Plan(dp_shard=2, tp=2), "llama-tiny", 64)["measured"]["max"]["total"]
    large = verify(Plan(dp_shard=8, tp=2), "llama-tiny", 64)["measured"]["max"]["total"]
    assert large < small / 3
