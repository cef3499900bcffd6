"""Replicated data parallelism: `dp_replicate` copies of the model (DDP, or the outer axis of HSDP),
one all-reduce of the (sharded) gradients per step.

Executor half: `dtorch.parallel.model` (DistributedDataParallel, or FSDP2's replicate axis).

Time: DDP's all-reduce, a small first bucket then one per `ddp_bucket_bytes`, each issued as its
gradients are ready and hidden behind the backward of the layers before it (`comm.prefetched`: the
last bucket is exposed), on the last micro-batch. HSDP (dp_shard x cp > 1): FSDP2 all-reduces each unit's reduce-scattered
gradient shard over the replicas, one all-reduce per unit, every micro-batch's backward without PP,
once per step with PP. Memory: two DDP buckets in flight when nothing is sharded.

With expert parallelism the replicas are FSDP2 HSDP units (`dtorch.parallel.expert.apply_fsdp_with_experts`,
a DDP plan's over one-rank shard groups): per unit, the non-expert gradients (their 1/(dp_shard x cp)
shard) all-reduced over the dp_replicate replicas, and the rank's own routed experts (1/ep of them, their
shard over the expert shard group) over the expert replica group only (`expert.expert_groups`: the
replicas the ep group does not span, at their stride); every micro-batch's backward without PP (FSDP2
syncs each one, DDP's `no_sync` does not apply), once per step with PP (the schedule defers it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dtorch.plan.comm import collective_time, prefetched
from dtorch.plan.step import RankMemory, StepShape
from dtorch.plan.strategies.base import Field, RankLoad, RankShare, Strategy
from dtorch.plan.strategies.expert import expert_groups, expert_shard, moe_blocks, stage_experts
from dtorch.plan.strategies.fsdp import FSDP, FsdpUnits

DDP_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True, slots=True)
class ReplicaUnit:
    """Data parallelism's per-plan term (`DataParallel.prepare`): one latency-bound all-reduce over
    the replicas (a DDP bucket's or an HSDP unit's fixed cost)."""

    ar_unit: float


class DataParallel(Strategy):
    name = "data"
    executor = "dtorch.parallel.model"
    fields = (Field("dp_replicate", "degree", aliases=("ddp",), mesh_position=1),)
    family_fields = ("dp_replicate", "dp_shard")

    def family(self, plan: Any) -> str | None:
        return "DDP" if plan.dp_replicate > 1 and plan.dp_shard == 1 else None

    def prepare(self, step: StepShape) -> bool:
        if step.plan.dp_replicate == 1:
            return False
        return step.keep(ReplicaUnit(collective_time("all_reduce", 1.0, step.plan.dp_replicate, step.st_dpr, step.g)))

    def rank_time(self, step: StepShape, load: RankLoad, r: RankShare, counts: Any) -> None:
        c, plan = step.c, step.plan
        bwd = 2.0 * r.compute / 3.0 + r.recompute
        if step.fs > 1 or (plan.ep > 1 and step.profile.num_experts):
            n = plan.num_microbatches if plan.pp == 1 else 1  # FSDP2 syncs every micro-batch without PP
            # one all-reduce per unit as its reduce-scatter lands, behind the next unit's backward:
            # it shares that window with FSDP's own backward traffic (its gather when resharded and
            # its reduce-scatter), so what shows is what the sum exposes beyond FSDP's alone
            units = load.blocks + 1
            ar_u = self.grad_comm(step, load, r.p_stage) / units
            own = 0.0
            if step.fs > 1 and not step.term(FsdpUnits).fixed_apart:
                ag, rs = FSDP.comm(step, load, r.p_stage)
                own = (rs + (ag if plan.reshard_after_forward and plan.pp == 1 else 0.0)) / units
            k = step.contention
            r.dp = n * (prefetched(own + ar_u, bwd / units, units, c, k) - prefetched(own, bwd / units, units, c, k))
            return
        # DDP: one all-reduce per bucket as its gradients are ready, behind the backward of the next
        # bucket's layers; the last bucket (the first layers) exposed
        grad_bytes = r.p_stage * step.red_b / step.fs
        buckets = max(1, math.ceil(grad_bytes / c.ddp_bucket_bytes))
        r.dp = prefetched(self.comm(step, grad_bytes) / buckets, bwd / buckets, buckets, c, step.contention)

    def bound_sync(self, step: StepShape, load: RankLoad, p_stage: float) -> float:
        return self.grad_comm(step, load, p_stage, latency=False) if step.plan.dp_replicate > 1 else 0.0

    def grad_comm(self, step: StepShape, load: RankLoad, p_stage: float, latency: bool = True) -> float:
        """Seconds of one gradient sync over the replicas of the `p_stage` parameters of pipeline rank
        `load`: DDP's bucketed all-reduce, or with EP the HSDP units' all-reduces (module doc), with a
        latency per unit (`latency=False`: none, the lower bound's)."""
        plan = step.plan
        if (plan.ep == 1 or not step.profile.num_experts) and step.fs > 1:
            # HSDP: each FSDP2 unit all-reduces its reduce-scattered shard over the replicas
            t = collective_time("all_reduce", p_stage * step.red_b / step.fs, plan.dp_replicate, step.st_dpr, step.g)
            return t + ((load.blocks + 1) * step.term(ReplicaUnit).ar_unit if latency else 0.0)
        if plan.ep == 1 or not step.profile.num_experts:
            return self.comm(step, p_stage * step.red_b / step.fs, bucket_latency=latency)
        g, st = step.g, step.st_dpr
        pe = stage_experts(plan, step.profile, load, p_stage)
        _, _, e_rep, e_st = expert_groups(plan)
        t = collective_time("all_reduce", (p_stage - pe) * step.red_b / step.fs, plan.dp_replicate, st, g)
        t += collective_time("all_reduce", pe / expert_shard(plan) * step.red_b, e_rep, e_st, g)
        if latency:  # one all-reduce per unit: every block and the root, every block's experts
            t += (load.blocks + 1) * step.term(ReplicaUnit).ar_unit
            t += moe_blocks(load, step.profile) * collective_time("all_reduce", 1.0, e_rep, e_st, g)
        return t

    def comm(self, step: StepShape, grad_bytes: float, bucket_latency: bool = True) -> float:
        """Seconds of the gradient all-reduce of `grad_bytes` per rank, with the latency of every
        bucket (`bucket_latency=False`: one all-reduce, the lower bound's)."""
        dpr, st, g = step.plan.dp_replicate, step.st_dpr, step.g
        ar = collective_time("all_reduce", grad_bytes, dpr, st, g)
        if not bucket_latency:
            return ar
        # DDP all-reduces a small first bucket, then one per `ddp_bucket_bytes`
        return ar + math.ceil(grad_bytes / step.c.ddp_bucket_bytes) * step.term(ReplicaUnit).ar_unit

    def rank_memory(self, step: StepShape, load: RankLoad, m: RankMemory) -> None:
        """DistributedDataParallel's buckets cover every gradient (float32, the masters' dtype: its
        reducer copies each gradient into them), allocated once; replicas run as FSDP2 units over
        one-rank shard groups (with TP or PP, `dtorch.parallel.model`) hold their unsharded copy of
        the stage in param_dtype, never resharded."""
        plan = step.plan
        if step.fs > 1 or plan.ep > 1 or plan.dp_replicate == 1:
            return
        if plan.tp == 1 and plan.pp == 1:
            m.buffers = 4.0 * m.p_stage
        else:
            m.states["params"] = m.states.get("params", 0.0) + m.p_gathered * step.param_b

    def buffers(self, plan: Any) -> float:
        if plan.dp_replicate > 1 and plan.dp_shard * plan.cp == 1:
            return 2 * DDP_BUCKET_BYTES  # DDP's default 25 MiB buckets, two in flight
        return 0.0


DATA = DataParallel()
