"""Micro-batching: `microbatch_size` samples per micro-batch, `num_microbatches` per step per
data-parallel rank (pipeline micro-batches, or gradient-accumulation steps without PP).

Executor half: `dtorch.parallel.parallelize` (the step splits the local batch).
``global_batch = dp_replicate * dp_shard * microbatch_size * num_microbatches``.

Uneven work (mixed devices, docs/heterogeneous.md): `dp_shares`, declared here, gives each
data-parallel rank its own number of micro-batches per step. `num_microbatches` stays the mean, so
the global batch is the same formula: ``microbatch_size * sum(dp_shares)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from dtorch.cluster.spec import Cluster
from dtorch.plan import hetero
from dtorch.plan.strategies.base import Dims, Field, Limit, Strategy, Violation, positive_int


class Batch(Strategy):
    name = "batch"
    executor = "dtorch.parallel.parallelize"
    fields = (
        Field("microbatch_size", "int", aliases=("microbatch", "mbs", "micro_batch")),
        Field("num_microbatches", "int", aliases=("nmb", "microbatches")),
        Field("dp_shares", "list", fixable=False, plan_type="list[int] | None", default=None,
              doc="Micro-batches per step of each data-parallel rank (dp_replicate * dp_shard entries, in "
                  "data-parallel rank order) for uneven work across mixed devices; None: num_microbatches "
                  "each. They sum to dp * num_microbatches (the global batch is unchanged)."),
    )

    def rules(self, plan: Any, dims: Dims | None) -> Iterator[Violation]:
        dp = plan.dp_replicate * plan.dp_shard
        local = plan.microbatch_size * plan.num_microbatches
        if plan.global_batch is not None and plan.global_batch != dp * local:
            yield Violation("global_batch", plan.global_batch,
                            f"dp({dp}) * microbatch_size({plan.microbatch_size}) * num_microbatches"
                            f"({plan.num_microbatches}) = {dp * local}; make them agree")
        shares = plan.dp_shares
        if shares is None:
            return
        if not isinstance(shares, (list, tuple)) or not all(positive_int(n) for n in shares):
            yield Violation("dp_shares", shares, "give one positive micro-batch count per data-parallel rank")
        elif len(shares) != dp:
            yield Violation("dp_shares", shares, f"give {dp} counts (dp_replicate * dp_shard), one per data-parallel rank")
        elif sum(shares) != dp * plan.num_microbatches:
            yield Violation("dp_shares", shares, f"the counts sum to {sum(shares)}; they must sum to dp({dp}) * "
                            f"num_microbatches({plan.num_microbatches}) = {dp * plan.num_microbatches}")

    def limits(self, plan: Any) -> Iterator[Limit]:
        shares = plan.dp_shares
        if shares is None or len(set(shares)) <= 1:
            return
        if plan.ep > 1:
            yield Limit("uneven data-parallel shares cannot run with expert parallelism (the expert all-to-all "
                        "needs every rank of the group at every micro-batch)", "dp_shares", shares,
                        "leave dp_shares unset (even shares) or use ep=1")
        if (plan.dp_shard > 1 or plan.cp > 1) and plan.reshard_after_forward:
            yield Limit("uneven data-parallel shares under FSDP keep the gathered parameters for the whole step "
                        "(ranks with different micro-batch counts must issue the same collectives)",
                        "reshard_after_forward", True, "set reshard_after_forward=false with uneven dp_shares")
        if plan.pp > 1 and plan.schedule != "gpipe" and min(shares) < plan.pp:
            yield Limit(f"schedule {plan.schedule} with pp={plan.pp} needs at least {plan.pp} micro-batches on "
                        "every data-parallel rank", "dp_shares", shares,
                        f"give every rank a share >= {plan.pp} or use schedule=gpipe")
        if plan.pp > 1 and plan.schedule in ("interleaved_1f1b", "zero_bubble") and any(n % plan.pp for n in shares):
            yield Limit(f"schedule {plan.schedule} runs micro-batches in rounds of pp={plan.pp} on every "
                        "data-parallel rank", "dp_shares", shares, f"give every rank a multiple of {plan.pp}")

    def describe(self, plan: Any):
        yield 0, f"mb={plan.microbatch_size}x{plan.num_microbatches}"
        if plan.dp_shares is not None:
            yield 1, "shares=" + _runs(plan.dp_shares)

    def variants(self, plan: Any, fixed: dict[str, Any], cluster: Cluster) -> list[Any]:
        """On a mixed cluster, `plan` with each data-parallel rank's micro-batches in proportion to
        its speed (`hetero.dp_shares`), at its micro-batch size and at 2, 4 and 8 times smaller ones
        (more micro-batches of the same global batch apportion more finely). Not where a
        collective runs per micro-batch across data-parallel ranks, which would then not pair up:
        FSDP sharding over dp_shard that gathers per micro-batch (no pipeline, or resharding), and
        expert parallelism's all-to-all."""
        if cluster is None or cluster.homogeneous or plan.dp_shares is not None or plan.dp < 2 or plan.ep > 1:
            return []
        if plan.dp_shard > 1 and (plan.pp == 1 or plan.reshard_after_forward):
            return []
        out = []
        for k in (1, 2, 4, 8):
            if plan.microbatch_size % k or (k > 1 and ("microbatch_size" in fixed or "num_microbatches" in fixed)):
                continue
            m = plan.num_microbatches * k
            shares = hetero.dp_shares(cluster, plan.pp, plan.dp, plan.cp, plan.tp, m, plan.schedule, plan.param_dtype
                                      if plan.param_dtype != "float8" else "bfloat16")
            if shares:
                out.append(replace(plan, microbatch_size=plan.microbatch_size // k, num_microbatches=m, dp_shares=shares))
        return out


def _runs(counts: list[int]) -> str:
    """``[1, 1, 3, 3]`` -> ``1x2/3x2``: counts as runs of equal values."""
    out, i = [], 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        out.append(str(counts[i]) + (f"x{j - i}" if j - i > 1 else ""))
        i = j
    return "/".join(out)


BATCH = Batch()
