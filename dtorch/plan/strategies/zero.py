"""ZeRO-1 and ZeRO-2 over the sharded data-parallel axis: the plan's `zero` field (0, 1, 2), declared here.

Megatron's distributed optimizer and DeepSpeed's stages 1-2: parameters replicated over data
parallelism for the whole step, the optimizer state sharded over it (ZeRO-1), and the gradients
too (ZeRO-2). `zero` changes what the `dp_shard` axis (x cp, as FSDP's) shards; 0 is FSDP's
ZeRO-3, the default, and is left out of plan documents (`Field.omit_default`), so every plan file
and golden plan written before it is unchanged.

Executor half: `dtorch.parallel.zero`, FSDP2 with its gradient-accumulation controls
(`set_requires_gradient_sync`, `set_reshard_after_backward`, ``reshard_after_forward=False``):
every unit all-gathers its parameters once per step, at the first micro-batch's forward, and keeps
them gathered until the last backward; ZeRO-1 accumulates full-size gradients locally over the
micro-batches and reduce-scatters them once, after the last; ZeRO-2 reduce-scatters every
micro-batch's gradients into the sharded ones. AdamW then steps on its shard only.

Time (as it runs): one all-gather per FSDP unit per step, hidden behind the first micro-batch's
forward at best (one block's never hidden); ZeRO-1 one reduce-scatter per unit per step behind the
last backward, whatever the micro-batch count; ZeRO-2 one per unit per micro-batch,
each behind its own backward. Memory: parameters = the float32 shard plus the whole stage gathered
in param_dtype (the whole step); gradients = for ZeRO-1 with more than one micro-batch the full-size
accumulation in reduce_dtype (FSDP2 accumulates unsharded gradients in reduce_dtype; each unit's is
freed as its shard is made), else the float32 shard; optimizer state sharded.

Search (`stages`, walked by `search._zero` beside every FSDP plan it tries): ZeRO-1 and ZeRO-2 where
they are another plan than FSDP's and the executor runs them, each down its own checkpointing
ladder; `not_searched` and `limits` are what `rejected` says elsewhere. `--fix zero=N` pins it.

Without a dp_shard x cp axis there is nothing to shard and `zero` changes nothing (`zero_stage`).
Limits: dp_replicate > 1 (DDP or HSDP replicas: not built for ZeRO), ZeRO-2 with expert
parallelism under a pipeline (the expert half builds its own units), ZeRO-2 under zero_bubble (the
schedule's weight backward runs apart from the input backward that fires FSDP's post-backward hook:
each unit's full-size gradients wait for a later micro-batch's input backward to reduce them, so
the number of reduce-scatters follows the schedule's order, 2 per unit instead of 4 on a second
stage at 4 micro-batches, and the unsharded gradients plus the shard outweigh ZeRO-1's; measured
at world 4 on gloo), parameter offload (FSDP's CPU offload keeps nothing gathered), ZeRO-2 with
uneven `dp_shares` (ranks would issue different numbers of reduce-scatters). `reshard_after_forward` does not apply under ZeRO (nothing is
resharded within a step).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dtorch.plan.comm import prefetched
from dtorch.plan.step import RankMemory, StepShape
from dtorch.plan.strategies.base import Dims, Field, Limit, RankLoad, RankShare, Strategy, Violation
from dtorch.plan.strategies.fsdp import FSDP, FsdpUnits

STAGES = (0, 1, 2)


def zero_stage(plan: Any) -> int:
    """The ZeRO stage the plan runs: 1 or 2, or 0 (off: FSDP's ZeRO-3 on dp_shard; or no dp_shard x cp
    axis, where there is nothing to shard and `zero` changes nothing, as Megatron's distributed
    optimizer at one data-parallel rank)."""
    z = getattr(plan, "zero", 0) or 0
    return z if plan.dp_shard * plan.cp > 1 else 0


class Zero(Strategy):
    name = "zero"
    executor = "dtorch.parallel.zero"
    fields = (Field("zero", "choice", choices=("0", "1", "2"), aliases=("zero_stage",),
                    value_aliases=(("off", "0"), ("none", "0"), ("false", "0")),
                    refuse=(("3", "ZeRO-3 is FSDP, the default on dp_shard: leave zero at 0"),),
                    plan_type="int", default=0, omit_default=True,
                    doc="ZeRO stage over dp_shard (x cp): 1 shards the optimizer state, 2 the gradients "
                        "too, parameters stay replicated; 0 (default) is FSDP (dtorch/parallel/zero.py)."),)
    family_fields = ("zero",)

    def rules(self, plan: Any, dims: Dims | None) -> Iterator[Violation]:
        z = plan.zero
        if isinstance(z, bool) or z not in STAGES:
            yield Violation("zero", z, "use 0 (off), 1 (optimizer state sharded) or 2 (gradients too)")

    def limits(self, plan: Any) -> Iterator[Limit]:
        if getattr(plan, "zero", 0) and plan.dp_replicate > 1:
            yield Limit("ZeRO over dp_replicate (DDP or HSDP replicas) is not built", "dp_replicate",
                        plan.dp_replicate, "put the data-parallel degree on dp_shard with zero, or use zero=0")
        z = zero_stage(plan)
        if not z:
            return
        if plan.ep > 1 and z == 2 and plan.pp > 1:
            yield Limit("ZeRO-2 with expert parallelism under a pipeline is not built (the expert half's units "
                        "keep the schedule's deferred reduction)", "zero", z, "use zero=1 with ep and pp")
        if plan.offload == "params":
            yield Limit("ZeRO keeps parameters gathered all step; parameter offload gathers them per unit",
                        "offload", plan.offload, "use offload=none or optimizer with zero")
        if z == 2 and plan.pp > 1 and plan.schedule == "zero_bubble":
            yield Limit("ZeRO-2 under zero_bubble is not built: torch's split weight backward runs after FSDP's "
                        "post-backward, so gradients stay full-size until a later micro-batch reduces them "
                        "(more memory than ZeRO-1, reductions by the schedule's order)", "zero", z,
                        "use zero=1 (or 0) with schedule=zero_bubble, or schedule=interleaved_1f1b with zero=2")
        shares = getattr(plan, "dp_shares", None)
        if z == 2 and shares is not None and len(set(shares)) > 1:
            yield Limit("ZeRO-2 reduce-scatters every micro-batch: uneven dp_shares would issue different "
                        "numbers of reduce-scatters per rank", "zero", z, "use zero=1 with uneven dp_shares")

    def family(self, plan: Any) -> str | None:
        z = zero_stage(plan)
        return f"ZeRO{z}" if z else None

    # ---- the search's candidates ----------------------------------------------------------------
    def stages(self, plan: Any, fixed: dict[str, Any]) -> tuple[int, ...]:
        """The stages the search tries beside FSDP's `plan` (zero=0), ZeRO-1 first (the faster; ZeRO-2
        saves its full-size gradients for a reduce-scatter per micro-batch). None where `--fix` pins
        `zero`, and where `not_searched` says why (no axis to shard, replicas, or the plan FSDP
        already is). Which of these the executor cannot run is the search's to report (`limits`)."""
        if "zero" in fixed or self.not_searched(plan, fixed):
            return ()
        return (1, 2) if plan.pp == 1 else (2,)

    @staticmethod
    def not_searched(plan: Any, fixed: dict[str, Any]) -> str | None:
        """Why the search tries no ZeRO stage on `plan`'s mesh and micro-batching, or None."""
        if fixed.get("offload") == "params":
            return "the fixed offload=params gathers parameters per unit; ZeRO keeps them gathered all step"
        if fixed.get("reshard_after_forward"):
            return "the fixed reshard_after_forward=true reshards within the step; ZeRO keeps parameters gathered"
        if plan.dp_shard * plan.cp == 1:
            return "no dp_shard x cp axis to shard the optimizer state over"
        if plan.dp_replicate > 1:
            # (the same data parallelism all on dp_shard is a mesh of its own, searched with ZeRO)
            return "ZeRO over dp_replicate (DDP or HSDP replicas) is not built"
        if plan.num_microbatches == 1:
            # one gather and one reduction per unit either way: the same step, the same bytes
            return "at one micro-batch per step ZeRO-1/2 run as FSDP without resharding (searched as that)"
        return None
    # (under a pipeline FSDP without resharding already gathers once and reduces once per step, as
    # torch's schedule drives it: ZeRO-1's traffic and memory (both accumulate full-size gradients in
    # reduce_dtype, measured), so only ZeRO-2, reducing every micro-batch into sharded gradients, is
    # another plan there)

    def describe(self, plan: Any):
        if zero_stage(plan):
            yield 50, f"zero{zero_stage(plan)}"

    # ---- time -----------------------------------------------------------------------------------
    def prepare(self, step: StepShape) -> bool:
        # FSDP's prepare (before this one in the registry) kept the per-unit costs this reads
        return bool(zero_stage(step.plan))

    def rank_time(self, step: StepShape, load: RankLoad, r: RankShare, counts: Any) -> None:
        """Replaces FSDP's `r.fsdp` (the data-parallel collectives of this axis) with ZeRO's."""
        r.fsdp = self.comm_time(step, load, r)

    def collectives(self, plan: Any) -> tuple[int, int]:
        """(all-gathers, reduce-scatters) per FSDP unit per step: one gather; ZeRO-1 one reduction,
        ZeRO-2 one per micro-batch (a unit belongs to one pipeline chunk)."""
        return 1, 1 if zero_stage(plan) == 1 else plan.num_microbatches

    def comm_time(self, step: StepShape, load: RankLoad, r: RankShare) -> float:
        plan, c, u = step.plan, step.c, step.term(FsdpUnits)
        n_ag, n_rs = self.collectives(plan)
        units = load.blocks + 1  # every block and the stage's root (embedding, final norm, head)
        if u.ag_byte or u.rs_byte:
            # the probe timed FSDP2's units with their bytes on this CPU: that, not the ring, is the cost
            ag = units * u.ag_unit + u.ag_byte * r.p_stage * step.param_b
            rs = units * u.rs_unit + u.rs_byte * r.p_stage * step.red_b
            return n_ag * ag + n_rs * rs
        ag, rs = FSDP.comm(step, load, r.p_stage, unit_latency=not u.fixed_apart)
        # one unit at a time, prefetched one ahead, as FSDP's (`prefetched`): the step's one gather per
        # unit behind the first micro-batch's forward, each reduction behind the backward it ends
        fwd, bwd = r.compute / 3.0, 2.0 * r.compute / 3.0 + r.recompute
        ag_u, rs_u, k = ag / units, rs / units, step.contention
        t = prefetched(ag_u, fwd / units, units, c, k) + n_rs * prefetched(rs_u, bwd / units, units, c, k)
        if u.fixed_apart:
            t += units * (n_ag * u.ag_unit + n_rs * u.rs_unit)
        return t

    # ---- memory ---------------------------------------------------------------------------------
    def rank_memory(self, step: StepShape, load: RankLoad, m: RankMemory) -> None:
        plan = step.plan
        if not zero_stage(plan):
            return
        shard = 0.0 if plan.offload == "params" else 4.0 * m.p_local  # float32 masters / gradients, this rank's
        # the whole stage gathered in param_dtype from the first forward to the last backward
        m.states["params"] = m.states.get("params", 0.0) + m.p_gathered * step.param_b
        if zero_stage(plan) == 1 and plan.num_microbatches > 1:
            # the full-size accumulation, reduced once after the last micro-batch: each unit's is
            # freed as its shard is made, so the two never coexist
            m.states["grads"] = m.p_gathered * step.red_b
        elif plan.num_microbatches > 1 or plan.pp > 1:
            m.states["grads"] = shard  # every micro-batch reduce-scattered into the shard
        # (one micro-batch without a pipeline: what coexists at the peak, `memory.at_peak`)


ZERO = Zero()
