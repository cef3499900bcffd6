"""Tensor parallelism with optional sequence parallelism (Megatron-style column/row split of the
linear layers over `tp` ranks of one node; `sp` shards norms and dropout on the sequence).

Executor half: `dtorch.parallel.tp` (DTensor parallel styles per block role).

Time (Korthikanti et al. 2022): per block per micro-batch 4 all-gathers/reduce-scatters of the
activation (tokens x hidden x dtype bytes) forward and 4 backward, 4 more when full AC recomputes,
plus the latency-bound small collectives counted by `step_counts`; exposed unless async TP
(`async_tp_factor`); each of them also waits for the slowest peer (`Link.skew`, probed on CPUs). Memory: activations divided by tp with SP; without SP 10/34 of them stay
replicated (Korthikanti Table 2, "TP only").
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dtorch.cluster.spec import Cluster
from dtorch.model.profile import ModelProfile
from dtorch.plan.comm import functional_time, sync_skew
from dtorch.plan.step import CostConstants, StepCounts, StepShape
from dtorch.plan.strategies.base import (
    Dims,
    Field,
    RankLoad,
    RankShare,
    Strategy,
    Violation,
    braces,
    divisors,
)
from dtorch.plan.strategies.memory import recompute_reruns_collectives, regathers


@dataclass(frozen=True, slots=True)

class TensorSmall:
    """The tensor strategy's per-plan term: seconds of one latency-bound TP collective."""

    small_s: float


class Tensor(Strategy):
    name = "tensor"
    executor = "dtorch.parallel.tp"
    fields = (
        Field("tp", "degree", aliases=("tensor_parallel",), mesh_position=4),
        Field("sp", "bool", aliases=("sequence_parallel",)),
    )
    family_fields = ("tp", "sp")
    refusal_fields = ("tp",)
    bound_terms = True  # its activation traffic is large on every plan of a mesh: the search's bound adds it

    def unsupported_for(self, profile: ModelProfile) -> str | None:
        if not profile.num_heads:
            return "no attention heads found (tensor parallelism splits attention by heads)"
        return profile.tp_roles_reason or None

    def rules(self, plan: Any, dims: Dims | None) -> Iterator[Violation]:
        if plan.sp and plan.tp == 1:
            yield Violation("sp", plan.sp, "sequence parallelism needs tp > 1; set sp=false or raise tp")
        if dims is None:
            return
        heads, kv = dims.num_heads, dims.num_kv_heads
        if heads % plan.tp or kv % plan.tp:
            ok = [t for t in divisors(math.gcd(heads, kv)) if not dims.world_size or dims.world_size % t == 0]
            what = f"{heads} attention heads" if heads % plan.tp else f"{kv} key/value heads"
            yield Violation("tp", plan.tp, f"tensor parallel degree {plan.tp} does not divide {what} "
                            f"({heads} query, {kv} key/value); use tp in {braces(ok)}")
        seq = dims.seq_len
        if seq is not None and plan.tp > 1 and plan.sp and plan.cp == 1 and seq % plan.tp:
            yield Violation(dims.seq_field or "sp", seq if dims.seq_field else plan.sp,
                            f"sequence parallelism splits the sequence over tp={plan.tp}; "
                            f"use a seq_len that is a multiple of {plan.tp}")

    def family(self, plan: Any) -> str | None:
        if plan.tp > 1:
            return "TP+SP" if plan.sp else "TP"
        return None

    def describe(self, plan: Any):
        if plan.sp:
            yield 20, "sp"

    # ---- search candidates ---------------------------------------------------------------------
    def degrees(self, heads: int, kv_heads: int, devices_per_node: int, world_size: int) -> list[int]:
        """TP degrees that divide the query and key/value heads and fit in one node."""
        g = math.gcd(heads, kv_heads)
        return [t for t in divisors(g) if devices_per_node % t == 0 and world_size % t == 0]

    def mesh_degrees(self, rest: int, profile: ModelProfile, cluster: Cluster, picked: dict[str, int]) -> list[int]:
        # MoE meshes search tp=1 unless tp is fixed (`--fix tp=2` runs: expert-tensor parallelism): with
        # tp free the DeepSeek-V3 search on 256 GPUs grows from ~500 to ~20,000 plans (4 s against 0.05 s)
        if profile.num_experts:
            return [1]
        return self.degrees(profile.num_heads, profile.num_kv_heads, cluster.devices_per_node, cluster.world_size)

    def optimistic(self, degrees: dict[str, int]) -> dict[str, Any]:
        return {"sp": degrees["tp"] > 1}

    # ---- time and memory -----------------------------------------------------------------------
    def prepare(self, step: StepShape) -> bool:
        tp, g = step.plan.tp, step.g
        if tp == 1:
            return False
        step.tp_act = functional_time("all_gather", step.act_full, tp, 1, g)  # (shared: expert's ETP term)
        return step.keep(TensorSmall(functional_time("all_gather", 64.0, tp, 1, g)))  # latency-bound

    def _activation_collectives(self, step: StepShape) -> int:
        # (sequence parallelism's backward re-gathers the attention's and feed-forward's inputs: 2)
        return (8 + (4 if recompute_reruns_collectives(step.plan.ac, step.selective) else 0)
                + (2 if regathers(step.plan) else 0))

    def blocking_collectives(self, step: StepShape, load: RankLoad, counts: StepCounts) -> float:
        # every TP collective sits between two operators of the block (async TP overlaps its
        # all-gathers with the matmul, not with the peers' arrival)
        return load.blocks * self._activation_collectives(step) + counts.tp_small_per_microbatch

    def rank_time(self, step: StepShape, load: RankLoad, r: RankShare, counts: StepCounts) -> None:
        c, small = step.c, step.term(TensorSmall).small_s
        n_ops = self._activation_collectives(step)
        r.tp = load.blocks * n_ops * step.tp_act + counts.tp_small_per_microbatch * small  # norms, RoPE, loss
        r.tp *= c.tp_exposed * (c.async_tp_factor if step.async_tp else 1.0)
        # each waits for the slowest TP peer after the stretch of work since the last one
        r.tp += self.blocking_collectives(step, load, counts) * sync_skew(step.g.intra, r.segment_s(), step.plan.tp)
        r.tp_step = counts.tp_small_per_step * small * c.tp_exposed

    def counts(self, plan: Any, blocks: float, head_share: float, c: CostConstants, selective: str) -> dict[str, float]:
        if plan.tp == 1:
            return {}  # (the fields' default, 0; asked per rank of every plan the search prices)
        per_mb, per_step = self.small_collectives(plan, blocks, head_share, c, selective)
        return {"tp_small_per_microbatch": per_mb, "tp_small_per_step": per_step}

    def small_collectives(self, plan: Any, blocks: float, head_share: float, c: CostConstants,
                          selective: str = "matmuls_saved") -> tuple[float, float]:
        """Latency-bound TP collectives (per micro-batch, per step) of a rank with `blocks` blocks and
        `head_share` of the embedding and head: DTensor redistributions counted on the reference
        Llama (`tp_small_collectives_per_block`, `tp_collectives_head`, `tp_collectives_per_step`)."""
        if plan.tp == 1:
            return 0.0, 0.0
        f, b, r = c.tp_small_collectives_per_block
        per_mb = blocks * (f + b + (r if recompute_reruns_collectives(plan.ac, selective) else 0.0)) + head_share * c.tp_collectives_head
        return per_mb, blocks * c.tp_collectives_per_step[0] + c.tp_collectives_per_step[1]


TENSOR = Tensor()
