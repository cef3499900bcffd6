"""Context parallelism: the sequence split over `cp` ranks inside attention, load-balanced into 2*cp
chunks; the keys of the other ranks reach a rank's queries one of two ways, the plan's
`cp_attention` (declared here): ``allgather`` (Llama 3's: K and V all-gathered before attention)
or ``ring`` (K/V blocks passed round the cp ring while each block is attended).

Executor half: `dtorch.parallel.cp` (with pipeline parallelism too: every stage runs on the local
tokens).

Time, per block and micro-batch on one rank (`rank_time`):

- allgather: K and V all-gathered forward (again when AC recomputes), their gradients
  reduce-scattered in backward; issued before attention, so exposed; latency as the probe timed a
  functional collective.
- ring: cp-1 point-to-point steps forward, each moving 1/cp of the K/V to the next rank while the
  rank attends to the block it holds (1/cp of its attention), so only what a step's transfer
  exceeds that attention shows; backward the blocks go round again with their float32 gradient
  accumulators (two transfers a step under 1/cp of the attention backward), and the last
  accumulator's hop home is exposed. On an oversubscribed CPU host the transfer and the attention
  share the cores: nothing hides.

Both wait for the slowest peer (`Link.skew`) once per exchange. The search prices both for every cp
plan (`variants`) and keeps the faster. The GEMM rows of a rank are the micro-batch's tokens / cp
(the step shape's `rows`); FSDP shards over dp_shard x cp.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dtorch.cluster.spec import Cluster
from dtorch.model.profile import ModelProfile
from dtorch.plan.comm import functional_time, oversubscribed, p2p_time, sync_skew
from dtorch.plan.step import StepCounts, StepShape
from dtorch.plan.strategies.base import Dims, Field, Limit, RankLoad, RankShare, Strategy, Violation, divisors
from dtorch.plan.strategies.memory import recompute_reruns_collectives

MAX_CP = 64
"""The largest context-parallel degree the search tries."""
METHODS = ("allgather", "ring")
"""The ways `cp_attention` reaches the other ranks' keys."""


@dataclass(frozen=True, slots=True)
class KvExchange:
    """Context parallelism's per-plan term (`Context.prepare`): seconds of one K/V all-gather over
    cp; of one ring step's K/V block and of its float32 gradient accumulator to the next rank; of a
    rank's attention core per block and micro-batch, forward and backward (the ring hides behind it)."""

    kv_s: float
    ring_kv_s: float
    ring_dkv_s: float
    attn_fwd_s: float
    attn_bwd_s: float
    overlap: bool


class Context(Strategy):
    name = "context"
    executor = "dtorch.parallel.cp"
    fields = (Field("cp", "degree", aliases=("context_parallel",), mesh_position=3),
              Field("cp_attention", "choice", METHODS, plan_type="str", default="allgather",
                    doc="How context-parallel attention reaches the other ranks' keys: allgather (K/V "
                        "all-gathered, exposed) or ring (K/V blocks passed round the cp ranks behind the "
                        "attention of the block held); dtorch/parallel/cp.py."))
    family_fields = ("cp",)
    refusal_fields = ("cp",)

    def unsupported_for(self, profile: ModelProfile) -> str | None:
        if profile.context_reason:
            return profile.context_reason
        if profile.input_kind != "tokens":
            return "the model's input is not a token sequence (context parallelism splits the sequence)"
        if not profile.num_heads:
            return "no attention found (context parallelism splits attention over the sequence)"
        return None

    def rules(self, plan: Any, dims: Dims | None) -> Iterator[Violation]:
        if plan.cp_attention not in METHODS:
            yield Violation("cp_attention", plan.cp_attention, f"use one of {', '.join(METHODS)}")
        if dims is None or dims.seq_len is None or plan.cp == 1:
            return
        unit = 2 * plan.cp * plan.tp
        if dims.seq_len % unit:
            yield Violation(dims.seq_field or "cp", dims.seq_len if dims.seq_field else plan.cp,
                            f"context parallel splits the sequence into tp*2*cp = {unit} load-balanced chunks, "
                            f"but seq_len {dims.seq_len} is not divisible by 2*cp*tp = {unit}; "
                            f"use a multiple of {unit} (or a cp whose 2*cp*tp divides it)")

    def limits(self, plan: Any) -> Iterator[Limit]:
        if plan.cp > 1 and plan.cp_attention == "ring" and getattr(plan, "compile", False):
            # the ring's point-to-point exchange sits in an autograd Function torch.compile was not tried on
            yield Limit("ring attention under torch.compile is not built by this executor", "cp_attention",
                        plan.cp_attention, "use cp_attention=allgather or compile=false")

    def family(self, plan: Any) -> str | None:
        return "CP" if plan.cp > 1 else None

    def describe(self, plan: Any):
        if plan.cp > 1 and plan.cp_attention == "ring":
            yield 15, "cp-ring"

    def degrees(self, rest: int, seq_len: int, tp: int) -> list[int]:
        return [c for c in divisors(rest) if c <= MAX_CP and seq_len % (2 * c * tp) == 0 or c == 1]

    def mesh_degrees(self, rest: int, profile: ModelProfile, cluster: Cluster, picked: dict[str, int]) -> list[int]:
        return self.degrees(rest, profile.seq_len, picked["tp"])  # (the 2*cp*tp chunks: tp is picked first)

    def variants(self, plan: Any, fixed: dict[str, Any], cluster: Cluster) -> list[Any]:
        """The other attention for a cp plan, unless `--fix` pinned one: the estimate picks."""
        if plan.cp == 1 or "cp_attention" in fixed:
            return []
        other = dataclasses.replace(plan, cp_attention="ring" if plan.cp_attention == "allgather" else "allgather")
        return [] if next(self.limits(other), None) is not None else [other]

    # ---- time ----------------------------------------------------------------------------------
    def prepare(self, step: StepShape) -> bool:
        plan = step.plan
        if plan.cp == 1:
            return False
        kv_dim = step.h * step.profile.num_kv_heads / step.profile.num_heads
        kv_bytes = 2.0 * step.tokens_mb * kv_dim * step.act_b / plan.tp  # the whole sequence's K and V
        inside = step.st_cp * plan.cp <= step.g.devices_per_node
        hop = step.st_cp if inside else step.g.devices_per_node  # a ring across nodes waits for its slowest hop
        # a rank's attention core per block and micro-batch (compute_time's attention part, per block)
        attn_s = step.tokens_mb * 3 * step.attn_fwd / (plan.tp * plan.cp) / step.attn_speed
        return step.keep(KvExchange(
            kv_s=functional_time("all_gather", kv_bytes, plan.cp, step.st_cp, step.g),
            ring_kv_s=p2p_time(kv_bytes / plan.cp, hop, step.g),
            ring_dkv_s=p2p_time(kv_bytes / plan.cp * 4.0 / step.act_b, hop, step.g),
            attn_fwd_s=attn_s / 3.0, attn_bwd_s=attn_s * 2.0 / 3.0,
            overlap=not oversubscribed(step.g)))

    def blocking_collectives(self, step: StepShape, load: RankLoad, counts: StepCounts) -> float:
        # forward exchange (once more when AC recomputes the block), backward exchange: the
        # all-gather and its reduce-scatter, or the ring's steps, which wait on the neighbours
        return load.blocks * (2 + (1 if recompute_reruns_collectives(step.plan.ac, step.selective) else 0))

    def rank_time(self, step: StepShape, load: RankLoad, r: RankShare, counts: StepCounts) -> None:
        plan, t = step.plan, step.term(KvExchange)
        rerun = 1 if recompute_reruns_collectives(plan.ac, step.selective) else 0
        if plan.cp_attention == "ring":
            fwd, bwd = ring_exposed(plan.cp, t)
            per_block = fwd * (1 + rerun) + bwd
        else:
            per_block = t.kv_s * (2 + rerun)
        inside = step.st_cp * plan.cp <= step.g.devices_per_node
        # each exchange also waits for the slowest peer after the stretch of work since the last one
        skew = sync_skew(step.g.intra if inside else step.g.inter, r.segment_s(), plan.cp)
        r.cp = load.blocks * (per_block + (2 + rerun) * skew)


def ring_exposed(cp: int, t: KvExchange) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one block's ring exchange: per step what the transfer
    exceeds the attention of the block held (all of it where nothing overlaps), and backward the
    last accumulator's hop home."""
    hide_f = t.attn_fwd_s / cp if t.overlap else 0.0
    hide_b = t.attn_bwd_s / cp if t.overlap else 0.0
    fwd = (cp - 1) * max(0.0, t.ring_kv_s - hide_f)
    bwd = (cp - 1) * max(0.0, t.ring_kv_s + t.ring_dkv_s - hide_b) + t.ring_dkv_s
    return fwd, bwd


CONTEXT = Context()
