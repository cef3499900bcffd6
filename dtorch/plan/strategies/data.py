"""Replicated data parallelism: `dp_replicate` copies of the model (DDP, or the outer axis of HSDP),
one all-reduce of the (sharded) gradients per step.

Executor half: `dtorch.parallel.model` (DistributedDataParallel, or FSDP2's replicate axis).

Time: the all-reduce, a small first bucket then one per `ddp_bucket_bytes`, overlapped with the last
micro-batch's backward. Memory: two DDP buckets in flight when nothing is sharded.
"""

from __future__ import annotations

import math
from typing import Any

from dtorch.plan.comm import collective_time, exposed
from dtorch.plan.strategies.base import Field, RankLoad, RankShare, Strategy

DDP_BUCKET_BYTES = 25 * 2**20


class DataParallel(Strategy):
    name = "data"
    executor = "dtorch.parallel.model"
    fields = (Field("dp_replicate", "degree", aliases=("ddp",), mesh_position=1),)
    family_fields = ("dp_replicate", "dp_shard")

    def family(self, plan: Any) -> str | None:
        return "DDP" if plan.dp_replicate > 1 and plan.dp_shard == 1 else None

    def prepare(self, step: Any) -> bool:
        if step.plan.dp_replicate == 1:
            return False
        step.ar_unit = collective_time("all_reduce", 1.0, step.plan.dp_replicate, step.st_dpr, step.g)
        return True

    def rank_time(self, step: Any, load: RankLoad, r: RankShare, counts: Any) -> None:
        c = step.c
        grad_bytes = r.p_stage * step.red_b / step.fs
        r.dp = exposed(self.comm(step, grad_bytes), (2.0 / 3.0) * r.compute, c)

    def comm(self, step: Any, grad_bytes: float, bucket_latency: bool = True) -> float:
        """Seconds of the gradient all-reduce of `grad_bytes` per rank, with the latency of every
        bucket (`bucket_latency=False`: one all-reduce, the lower bound's)."""
        dpr, st, g = step.plan.dp_replicate, step.st_dpr, step.g
        ar = collective_time("all_reduce", grad_bytes, dpr, st, g)
        if not bucket_latency:
            return ar
        # DDP all-reduces a small first bucket, then one per `ddp_bucket_bytes`
        return ar + math.ceil(grad_bytes / step.c.ddp_bucket_bytes) * step.ar_unit

    def buffers(self, plan: Any) -> float:
        if plan.dp_replicate > 1 and plan.dp_shard * plan.cp == 1:
            return 2 * DDP_BUCKET_BYTES  # DDP's default 25 MiB buckets, two in flight
        return 0.0


DATA = DataParallel()
