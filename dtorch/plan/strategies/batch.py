"""Micro-batching: `microbatch_size` samples per micro-batch, `num_microbatches` per step per
data-parallel rank (pipeline micro-batches, or gradient-accumulation steps without PP).

Executor half: `dtorch.parallel.parallelize` (the step splits the local batch).
``global_batch = dp_replicate * dp_shard * microbatch_size * num_microbatches``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dtorch.plan.strategies.base import Dims, Field, Strategy, Violation


class Batch(Strategy):
    name = "batch"
    executor = "dtorch.parallel.parallelize"
    fields = (
        Field("microbatch_size", "int", aliases=("microbatch", "mbs", "micro_batch")),
        Field("num_microbatches", "int", aliases=("nmb", "microbatches")),
    )

    def rules(self, plan: Any, dims: Dims | None) -> Iterator[Violation]:
        dp = plan.dp_replicate * plan.dp_shard
        local = plan.microbatch_size * plan.num_microbatches
        if plan.global_batch is not None and plan.global_batch != dp * local:
            yield Violation("global_batch", plan.global_batch,
                            f"dp({dp}) * microbatch_size({plan.microbatch_size}) * num_microbatches"
                            f"({plan.num_microbatches}) = {dp * local}; make them agree")

    def describe(self, plan: Any):
        yield 0, f"mb={plan.microbatch_size}x{plan.num_microbatches}"


BATCH = Batch()
