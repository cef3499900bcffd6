"""Pipeline parallelism: the blocks split into stages over `pp` ranks, micro-batches flowing through
a schedule (GPipe, 1F1B, interleaved 1F1B with `virtual_stages` chunks per rank, zero-bubble).

Executor half: `dtorch.parallel.pipeline` (torch.distributed.pipelining stages and schedules).

Time: activations sent forward and gradients back per micro-batch and virtual stage; bubble
(p-1)/v micro-batch times for 1F1B/interleaved (Narayanan et al. 2021), (p-1) for GPipe, a third of
the 1F1B bubble for zero-bubble (ZB-H1, Qi et al. 2023). Memory: micro-batches in flight, 1 without
PP, min(p, m) for 1F1B/zero-bubble on the first stage, p (1 + (p-1)/(p v)) interleaved, m for GPipe.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

from dtorch.cluster.spec import Cluster
from dtorch.errors import choices
from dtorch.model.profile import ModelProfile
from dtorch.plan.comm import oversubscribed, p2p_time
from dtorch.plan.step import StepShape
from dtorch.plan.strategies.base import (
    Dims,
    Field,
    Limit,
    RankLoad,
    StepTerm,
    Strategy,
    Violation,
    divisors,
    positive_int,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
SCHEDULE_ALIASES = (("interleaved", "interleaved_1f1b"), ("zb", "zero_bubble"), ("zbv", "zero_bubble"))
ROUNDS = ("interleaved_1f1b", "zero_bubble")
PARTITION_MARGIN = 0.01
"""An uneven pipeline partition must be this much faster than the even split to be ranked above it."""
"""Schedules that run micro-batches in rounds of pp (torch's interleaved schedules)."""


class Pipeline(Strategy):
    name = "pipeline"
    executor = "dtorch.parallel.pipeline"
    fields = (
        Field("pp", "degree", aliases=("pipeline_parallel",), mesh_position=0),
        Field("schedule", "choice", SCHEDULES, value_aliases=SCHEDULE_ALIASES),
        Field("virtual_stages", "int", aliases=("v", "vp", "vpp")),
        Field("layer_partition", "list", fixable=False),
    )
    family_fields = ("pp",)
    refusal_fields = ("pp",)

    def unsupported_for(self, profile: ModelProfile) -> str | None:
        # the profiler tries the cut on the meta model (dtorch.model.split), ties across the first
        # and last stage included: a tie the executor cannot keep in sync is a reason there
        if profile.pipeline_reason:
            return profile.pipeline_reason
        if profile.num_layers < 2:
            return f"{profile.num_layers} repeated block(s): nothing to cut into stages"
        return None

    def rules(self, plan: Any, dims: Dims | None) -> Iterator[Violation]:
        pp, v, m = plan.pp, plan.virtual_stages, plan.num_microbatches
        if plan.schedule not in SCHEDULES:
            yield Violation("schedule", plan.schedule, choices(SCHEDULES))
            return
        if pp == 1 and v != 1:
            yield Violation("virtual_stages", v, "virtual stages need pp > 1; set 1")
        if v > 1 and plan.schedule in ("gpipe", "1f1b"):
            yield Violation("virtual_stages", v, f"schedule {plan.schedule} runs one stage per rank; "
                            "use schedule=interleaved_1f1b or virtual_stages=1")
        if pp > 1 and m < pp and plan.schedule != "gpipe":
            yield Violation("num_microbatches", m, f"schedule {plan.schedule} with pp={pp} needs at least {pp} "
                            f"micro-batches; use num_microbatches >= {pp} or schedule=gpipe")
        if pp > 1 and plan.schedule in ROUNDS and m % pp:
            yield Violation("num_microbatches", m, f"schedule {plan.schedule} runs micro-batches in rounds of "
                            f"pp={pp}; use a multiple of {pp}")
        stages = pp * v
        part = plan.layer_partition
        if part is not None and (len(part) != stages or any(not positive_int(n) for n in part)):
            yield Violation("layer_partition", part, f"give {stages} positive block counts (pp * virtual_stages), "
                            "or null for even")
            return
        if dims is None:
            return
        L = dims.num_layers
        if pp > L:
            ok = [p for p in divisors(dims.world_size) if p <= L] if dims.world_size else None
            yield Violation("pp", pp, f"pipeline degree above the {L} blocks of {dims.name}; "
                            + (f"use pp in {{{', '.join(map(str, ok))}}}" if ok else f"use pp <= {L}"))
        elif stages > L:
            yield Violation("virtual_stages", v, f"pp*virtual_stages = {stages} stages for {L} blocks; "
                            f"use at most {L} stages (virtual_stages <= {L // pp})")
        if part is not None and sum(part) != L:
            yield Violation("layer_partition", part, f"the counts sum to {sum(part)} but the model has {L} blocks")

    def limits(self, plan: Any) -> Iterator[Limit]:
        if plan.pp > 1 and plan.schedule == "zero_bubble" and plan.ac == "selective":
            # zero-bubble runs a stage's backward in two passes (input, then weight gradients); torch's
            # selective checkpointing allows one backward per recomputed region ("Trying to backward an
            # extra time"), seen on a 2-worker gloo job re-planned after an OOM
            yield Limit("zero-bubble with selective activation checkpointing fails in torch 2.13; use ac=full or "
                        "another schedule", "schedule", plan.schedule, "use schedule=interleaved_1f1b or ac=full")
        if (plan.pp > 1 and plan.schedule == "zero_bubble" and (plan.dp_shard > 1 or plan.cp > 1)
                and plan.reshard_after_forward):
            # torch's split backward (pipelining/_backward.py) finds a stage's weights through
            # `submod.parameters()` when its input-gradient pass starts; FSDP2 resharding after forward
            # has swapped the module's parameters back to the sharded DTensors by then, which the
            # forward graph never used, so the weight pass computes nothing: every stage but the first
            # (which runs a full backward) ends the step without gradients (measured: pp=2 x dp_shard=2,
            # dense and MoE alike; and pp=2 x cp=2, FSDP sharding over cp). Kept gathered, the forward's
            # parameters are the module's own.
            yield Limit("zero-bubble with FSDP resharding after forward loses the weight gradients of every stage "
                        "but the first in torch 2.13", "reshard_after_forward", True,
                        "set reshard_after_forward=false with schedule=zero_bubble, or use schedule=interleaved_1f1b")
        if plan.pp > 1 and plan.schedule == "zero_bubble" and plan.sp and plan.pp * plan.virtual_stages > 2:
            # the split input/weight backward of a middle stage fails on the sequence-parallel boundary
            # ("Can't detach views in-place"), measured on gloo with pp=2, v=2
            yield Limit("zero-bubble with sequence parallelism and middle pipeline stages fails in torch 2.13",
                        "schedule", plan.schedule, "use schedule=interleaved_1f1b, sp=false, or pp*virtual_stages=2")

    def family(self, plan: Any) -> str | None:
        return "PP" if plan.pp > 1 else None

    def describe(self, plan: Any):
        if plan.pp > 1:
            yield 10, plan.schedule + (f"(v={plan.virtual_stages})" if plan.virtual_stages > 1 else "")
        if plan.layer_partition is not None:
            yield 60, "stages=" + _runs(plan.layer_partition)

    # ---- search candidates ---------------------------------------------------------------------
    def degrees(self, rest: int, num_layers: int) -> list[int]:
        return [p for p in divisors(rest) if p <= num_layers]

    def mesh_degrees(self, rest: int, profile: ModelProfile, cluster: Cluster, picked: dict[str, int]) -> list[int]:
        return self.degrees(rest, profile.num_layers)

    def fixed_rules(self, fixed: dict[str, Any], profile: ModelProfile, world: int) -> Iterator[Violation]:
        v = fixed.get("virtual_stages", 1)
        if v > 1 and fixed.get("schedule") in ("gpipe", "1f1b"):
            yield Violation("virtual_stages", v, f"schedule {fixed['schedule']} runs one stage per rank; "
                            "use schedule=interleaved_1f1b")

    def optimistic(self, degrees: dict[str, int]) -> dict[str, Any]:
        sched, v = self.OPTIMISTIC if degrees["pp"] > 1 else ("1f1b", 1)
        return {"schedule": sched, "virtual_stages": v}

    def bound_pace(self, step: StepShape, t: float, n: int) -> float:
        plan = step.plan  # the bound's plan: the smallest bubble any schedule leaves (`optimistic`)
        return bubble_fraction(plan.pp, plan.virtual_stages, plan.schedule) * t / n

    def schedules(self, pp: int, nmb: int, L: int, fixed: dict[str, Any]) -> list[tuple[str, int]]:
        """(schedule, virtual_stages) worth searching for `nmb` micro-batches on `pp` ranks."""
        if pp == 1:
            return [(fixed.get("schedule", "1f1b"), 1)] if fixed.get("virtual_stages", 1) == 1 else []
        out: list[tuple[str, int]] = []
        want = fixed.get("schedule")
        vs = [fixed["virtual_stages"]] if "virtual_stages" in fixed else [1, 2, 4]
        for sched in ([want] if want else ["1f1b", "interleaved_1f1b", "zero_bubble"]):
            if sched != "gpipe" and nmb < pp:
                continue
            for v in vs:
                if pp * v > L:
                    continue
                if sched in ("gpipe", "1f1b") and v != 1:
                    continue
                if sched == "interleaved_1f1b" and (v == 1 or nmb % pp):
                    continue
                if sched == "zero_bubble" and (v > 2 or nmb % pp):
                    continue  # torch's interleaved zero-bubble schedule runs micro-batches in rounds of pp
                out.append((sched, v))
        return out

    def partitions(self, pp: int, v: int, num_layers: int, head_blocks: float) -> list[list[int] | None]:
        """Stage partitions to try: as even as possible (None) and, when it shortens the busiest
        pipeline rank, one that gives the rank holding the output head (worth `head_blocks` blocks)
        fewer blocks."""
        if pp == 1:
            return [None]
        return _partitions_cached(pp, v, num_layers, round(head_blocks, 3))

    def penalty(self, plan: Any) -> float:
        return 1.0 + PARTITION_MARGIN * (plan.layer_partition is not None)

    OPTIMISTIC = ("zero_bubble", 2)
    """The schedule that leaves the smallest bubble the search tries (the lower bound's)."""

    # ---- time ----------------------------------------------------------------------------------
    def pace_terms(self, step: StepShape, t_mb: float) -> tuple[StepTerm, ...]:
        """The bubble and the exposed point-to-point seconds of one step whose slowest stage takes
        `t_mb` per micro-batch (both 0 without a pipeline: the breakdown always shows them)."""
        t_p2p, t_bubble = self.step_time(step, t_mb)
        return StepTerm("bubble", t_bubble), StepTerm("pp_p2p", t_p2p)

    def step_time(self, step: StepShape, t_mb: float) -> tuple[float, float]:
        """(exposed point-to-point seconds, bubble seconds) of one step whose slowest stage takes
        `t_mb` per micro-batch."""
        plan, g, c = step.plan, step.g, step.c
        pp, m, v, tp = plan.pp, plan.num_microbatches, plan.virtual_stages, plan.tp
        if pp == 1:
            return 0.0, 0.0
        p2p_bytes = step.act_full / (tp if plan.sp or tp == 1 else 1)
        t_p2p = c.pp_p2p_exposed * 2.0 * p2p_time(p2p_bytes, step.st_pp, g) * (m * v + pp - 1)
        if oversubscribed(g):
            # The per-rank speed is a share of the cores measured with every rank busy; a stage idling
            # in the bubble hands its share to the stages that work, so the bubble costs only the cores
            # left idle while the pipeline fills and drains. Filling it with other work (zero-bubble's
            # deferred weight gradients, interleaving) moves work, it does not remove any: every
            # schedule pays the 1F1B ramp.
            return t_p2p, (pp - 1) * t_mb * g.host_cores / g.devices_per_node
        return t_p2p, bubble_fraction(pp, v, plan.schedule) * t_mb


PIPELINE = Pipeline()


def bubble_fraction(pp: int, v: int, schedule: str) -> float:
    """Bubble length in units of one micro-batch's stage time (fwd+bwd)."""
    if pp == 1:
        return 0.0
    if schedule == "gpipe":
        return float(pp - 1)
    if schedule == "zero_bubble":
        return (pp - 1) / (3.0 * v)
    return (pp - 1) / float(v)


def activation_in_flight(plan: Any, pp_rank: int = 0) -> float:
    """Micro-batches of activations pipeline rank `pp_rank` holds at peak (the first holds the most:
    1F1B keeps p - r in flight on rank r; interleaving adds (p-1)/(p v); GPipe keeps all m)."""
    p, m, v = plan.pp, plan.num_microbatches, plan.virtual_stages
    if p == 1:
        return 1.0
    if plan.schedule == "gpipe":
        return float(m)
    if v > 1:
        first = min(float(m), p * (1.0 + (p - 1) / (p * v)))
        return max(1.0, first * (p - pp_rank) / p)
    return float(min(p - pp_rank, m))


def even_partition(num_stages: int, num_layers: int) -> list[int]:
    """Blocks per stage as even as possible, the extra blocks on the earlier stages (exactly what
    `dtorch.parallel.pipeline.layer_partition` applies)."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def partition(plan: Any, num_layers: int) -> list[int]:
    """Blocks per pipeline stage: the plan's `layer_partition`, or `even_partition`."""
    if plan.layer_partition is not None:
        return list(plan.layer_partition)
    return even_partition(plan.pp * plan.virtual_stages, num_layers)


def rank_loads(plan: Any, num_layers: int, num_dense: int = 0) -> list[RankLoad]:
    """One RankLoad per pipeline rank (looped placement: rank r runs stages r, r + pp, ...);
    `num_dense`: a MoE model's dense first blocks, counted per rank in `RankLoad.dense_blocks`."""
    return list(_rank_loads(plan.pp, plan.virtual_stages, num_layers,
                            tuple(plan.layer_partition) if plan.layer_partition is not None else None, num_dense))


def distinct_loads(plan: Any, num_layers: int, num_dense: int = 0) -> tuple[RankLoad, ...]:
    """The ranks worth costing: ranks with the same blocks, embedding and head take the same time;
    of those, the first holds the most micro-batches in flight (activation_in_flight falls with the
    rank), and a middle rank with no more blocks than the first, and no more MoE blocks (a MoE
    model's dense first blocks are smaller), is dominated by it."""
    return _distinct_loads(plan.pp, plan.virtual_stages, num_layers,
                           tuple(plan.layer_partition) if plan.layer_partition else None, num_dense)


@lru_cache(maxsize=4096)
def _distinct_loads(pp: int, v: int, num_layers: int, sizes: tuple[int, ...] | None,
                    num_dense: int = 0) -> tuple[RankLoad, ...]:
    loads = _rank_loads(pp, v, num_layers, sizes, num_dense)
    first = loads[0]
    distinct: dict[tuple, RankLoad] = {}
    for ld in loads:
        # a middle rank with no more blocks than the first is dominated by it: no more time (the first
        # also runs the embedding) and no more memory (the first holds more micro-batches in flight)
        if (ld.pp_rank > 0 and not ld.head and ld.blocks <= first.blocks
                and ld.blocks - ld.dense_blocks <= first.blocks - first.dense_blocks):
            continue
        distinct.setdefault((ld.blocks, ld.embedding, ld.head, ld.dense_blocks), ld)
    return tuple(distinct.values())


@lru_cache(maxsize=4096)
def _rank_loads(pp: int, v: int, num_layers: int, sizes: tuple[int, ...] | None,
                num_dense: int = 0) -> tuple[RankLoad, ...]:
    sizes = list(sizes) if sizes is not None else even_partition(pp * v, num_layers)
    S = pp * v
    starts = [sum(sizes[:s]) for s in range(S)]
    out = []
    for r in range(pp):
        stages = range(r, S, pp)
        dense = sum(max(0, min(num_dense, starts[s] + sizes[s]) - starts[s]) for s in stages)
        out.append(RankLoad(r, sum(sizes[s] for s in stages), 0 in stages, S - 1 in stages, dense))
    return tuple(out)


def ideal_load(pp: int, num_layers: int, num_dense: int = 0) -> RankLoad:
    """A perfectly balanced pipeline rank: 1/pp of the blocks (and of a MoE model's dense ones), the
    embedding and the head (the search's lower bound)."""
    return RankLoad(0, num_layers / pp, 1.0 / pp, 1.0 / pp, num_dense / pp)


def balanced_partition(num_stages: int, num_layers: int, head_blocks: float, embed_blocks: float = 0.0) -> list[int]:
    """Blocks per stage that minimise the busiest stage when the last stage also carries work worth
    `head_blocks` blocks (output head and loss) and the first `embed_blocks` (input embedding): the
    first and last stages get fewer blocks where that evens the load. Every stage keeps >= 1 block."""
    S, L = num_stages, num_layers
    if S == 1:
        return [L]
    extra = [0.0] * S
    extra[0] += embed_blocks
    extra[-1] += head_blocks
    lo, hi = L / S, L / S + max(extra) + 1.0
    best = None
    for _ in range(50):  # bisection on the busiest stage's load
        cap = (lo + hi) / 2
        sizes = [max(1, math.floor(cap - e + 1e-9)) for e in extra]
        if sum(sizes) >= L:
            hi, best = cap, sizes
        else:
            lo = cap
    sizes = list(best or [L // S] * S)
    # trim the surplus from the stages with the most load (keeping >= 1 block), earliest first
    while sum(sizes) > L:
        i = max((j for j in range(S) if sizes[j] > 1), key=lambda j: (sizes[j] + extra[j], -j))
        sizes[i] -= 1
    return sizes


def _runs(sizes: list[int]) -> str:
    """``[1, 2, 2, 2, 1]`` -> ``1/2x3/1``: a partition as runs of equal stage sizes."""
    out: list[str] = []
    i = 0
    while i < len(sizes):
        j = i
        while j < len(sizes) and sizes[j] == sizes[i]:
            j += 1
        out.append(str(sizes[i]) + (f"x{j - i}" if j - i > 1 else ""))
        i = j
    return "/".join(out)


@lru_cache(maxsize=4096)
def _partitions_cached(pp: int, v: int, L: int, head: float) -> list[list[int] | None]:
    if L < pp * v:
        return [None]
    even = even_partition(pp * v, L)
    per_rank = balanced_partition(pp, L, head)  # blocks per pipeline rank, head on the last
    if any(n < v for n in per_rank):
        return [None]
    # each rank's blocks over its v looped stages (rank r runs stages r, r + pp, ...), earlier first
    bal = [0] * (pp * v)
    for r, n in enumerate(per_rank):
        base, extra = divmod(n, v)
        for k in range(v):
            bal[r + k * pp] = base + (1 if k < extra else 0)

    def busiest(sizes: list[int]) -> float:
        ranks = [sum(sizes[r::pp]) for r in range(pp)]
        ranks[-1] += head
        return max(ranks)

    # worth trying only where it can win the ranking's margin for uneven partitions
    return [None, bal] if bal != even and busiest(bal) < busiest(even) * (1.0 - PARTITION_MARGIN) else [None]
