"""Sharded data parallelism (FSDP2 / ZeRO-3) over `dp_shard` x cp, and HSDP with `dp_replicate`.

Executor half: `dtorch.parallel.fsdp` (fully_shard per block, then the root).

Time (ZeRO paper; FSDP2; torchtitan shards over dp_shard x cp): parameters all-gathered in
param_dtype before forward (and again before backward when `reshard_after_forward`), gradients
reduce-scattered in reduce_dtype, one unit (block, and the root's rest) at a time; per micro-batch
without PP (gradient accumulation as torchtitan does it), once per step with PP (gradients sync on
the last micro-batch only; parameters stay gathered when not resharding). Each unit's transfer is
prefetched behind one unit's compute (`comm.prefetched`): the first gather and the last
reduce-scatter are never hidden, and a unit whose transfer outlasts its compute shows the
difference. Memory: model states divided by the shard group; one gathered block plus a prefetch and
a gradient block in flight, or the whole stage when parameters stay gathered from forward to backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtorch.plan.comm import collective_time, prefetched, unit_fixed
from dtorch.plan.step import RankMemory, StepShape
from dtorch.plan.strategies.base import Field, RankLoad, RankShare, Strategy
from dtorch.plan.strategies.expert import EXPERT, gathered_block_params, held_block_params


@dataclass(frozen=True, slots=True)
class FsdpUnits:
    """FSDP's per-plan terms (`Sharded.prepare`): seconds of one unit's all-gather and
    reduce-scatter beside their bytes, the probe's per-byte seconds where it timed FSDP2 on this CPU,
    whether those fixed costs are paid apart from the overlap, and one block's gather."""

    ag_unit: float
    rs_unit: float
    ag_byte: float
    rs_byte: float
    fixed_apart: bool
    ag_block: float


class Sharded(Strategy):
    name = "fsdp"
    executor = "dtorch.parallel.fsdp"
    fields = (
        Field("dp_shard", "degree", aliases=("fsdp",), mesh_position=2),
        Field("reshard_after_forward", "bool", aliases=("reshard",)),
    )
    family_fields = ("dp_replicate", "dp_shard")

    def family(self, plan: Any) -> str | None:
        if plan.dp_shard > 1 and not getattr(plan, "zero", 0):  # (ZeRO-1/2 on this axis: strategies/zero.py)
            return "HSDP" if plan.dp_replicate > 1 else "FSDP"
        return None

    def describe(self, plan: Any):
        if plan.dp_shard * plan.cp > 1 and not plan.reshard_after_forward and not getattr(plan, "zero", 0):
            yield 50, "no-reshard"

    def prepare(self, step: StepShape) -> bool:
        fs, st, g = step.fs, step.st_fs, step.g
        if fs == 1:
            return False
        measured = unit_fixed(fs, st, g)
        ag_byte = rs_byte = 0.0
        if measured:
            # FSDP2's cost per unit as the probe timed it (hooks, copies, the collective's wait; and
            # per byte where measured); on a CPU it is paid by the thread that computes
            ag_unit, rs_unit, m_ag_byte, m_rs_byte = measured
            if step.cpu and step.plan.ep == 1:
                ag_byte, rs_byte = m_ag_byte, m_rs_byte
        else:
            ag_unit = collective_time("all_gather", 1.0, fs, st, g)
            rs_unit = collective_time("reduce_scatter", 1.0, fs, st, g)
        # one block's gather: the one nothing hides
        ag_block = collective_time("all_gather", gathered_block_params(step.profile, step.plan) * step.param_b,
                                   fs, st, g)
        return step.keep(FsdpUnits(ag_unit, rs_unit, ag_byte, rs_byte, bool(measured) and step.cpu, ag_block))

    def comm(self, step: StepShape, load: RankLoad, p_stage: float, unit_latency: bool = True) -> tuple[float, float]:
        """(all-gather, reduce-scatter) seconds of the `p_stage` parameters and their gradients of
        `load`, one collective per FSDP unit (`unit_latency=False`: one for all, the lower bound's)."""
        fs, st, g = step.fs, step.st_fs, step.g
        ep = step.plan.ep
        if ep > 1:
            # with EP the routed experts are sharded over ep and FSDP'd over edp = fs/ep only (ep innermost):
            # 1/ep of them gathered, over the slower outer ranks (`dtorch.parallel.expert.apply_fsdp_with_experts`)
            pe = min(p_stage, EXPERT.expert_stage_params(step, load))
            ag = (collective_time("all_gather", (p_stage - pe) * step.param_b, fs, st, g)
                  + collective_time("all_gather", pe / ep * step.param_b, max(1, fs // ep), st * ep, g))
            rs = (collective_time("reduce_scatter", (p_stage - pe) * step.red_b, fs, st, g)
                  + collective_time("reduce_scatter", pe / ep * step.red_b, max(1, fs // ep), st * ep, g))
        else:
            ag = collective_time("all_gather", p_stage * step.param_b, fs, st, g)
            rs = collective_time("reduce_scatter", p_stage * step.red_b, fs, st, g)
        if unit_latency:
            # FSDP2 gathers and reduces one unit (block, and the root's rest) at a time: one latency each
            u = step.term(FsdpUnits)
            ag += load.blocks * u.ag_unit
            rs += load.blocks * u.rs_unit
        return ag, rs

    def bound_sync(self, step: StepShape, load: RankLoad, p_stage: float) -> float:
        return sum(self.comm(step, load, p_stage, unit_latency=False)) if step.fs > 1 else 0.0

    def rank_time(self, step: StepShape, load: RankLoad, r: RankShare, counts: Any) -> None:
        plan, c, u = step.plan, step.c, step.term(FsdpUnits)
        apart = u.fixed_apart
        ag, rs = self.comm(step, load, r.p_stage, unit_latency=not apart)
        m = plan.num_microbatches
        units = load.blocks + 1  # every block and the stage's root (embedding, final norm, head)
        if u.ag_byte or u.rs_byte:
            # the probe timed FSDP2's units with their bytes on this CPU: that, not the ring, is the cost
            ag = units * u.ag_unit + u.ag_byte * r.p_stage * step.param_b
            rs = units * u.rs_unit + u.rs_byte * r.p_stage * step.red_b
            if plan.pp == 1:
                r.fsdp = m * ((2 if plan.reshard_after_forward else 1) * ag + rs)
            else:
                r.fsdp = (m * plan.virtual_stages * 2 if plan.reshard_after_forward else 1) * ag + rs
            return
        # one unit at a time, prefetched one ahead (`prefetched`): the forward gathers behind the
        # previous unit's forward, the backward's gather (resharded) and the previous unit's
        # reduce-scatter behind its backward; the first gather and the last reduce-scatter exposed
        fwd, bwd = r.compute / 3.0, 2.0 * r.compute / 3.0 + r.recompute
        ag_u, rs_u, k = ag / units, rs / units, step.contention
        if plan.pp == 1:
            # every micro-batch gathers and reduces (gradient accumulation as torchtitan does it)
            ag_b = ag_u if plan.reshard_after_forward else 0.0
            r.fsdp = m * (prefetched(ag_u, fwd / units, units, c, k)
                          + prefetched(ag_b + rs_u, bwd / units, units, c, k))
            if apart:
                r.fsdp += m * units * ((2 if plan.reshard_after_forward else 1) * u.ag_unit + u.rs_unit)
        else:
            v = plan.virtual_stages
            if plan.reshard_after_forward:
                # each micro-batch's pass through each virtual stage gathers its units, forward and backward
                runs, per_run = m * v, units / v
                r.fsdp = runs * (prefetched(ag_u, fwd / units, per_run, c, k)
                                 + prefetched(ag_u, bwd / units, per_run, c, k))
                gathers = m * v * 2
            else:  # gathered once, by the first micro-batch, and kept
                r.fsdp = prefetched(ag_u, fwd / units, units, c, k)
                gathers = 1
            # gradients sync on the last micro-batch only, behind its backward
            r.fsdp += prefetched(rs_u, bwd / units, units, c, k)
            if apart:
                r.fsdp += units * (gathers * u.ag_unit + u.rs_unit)

    def rank_memory(self, step: StepShape, load: RankLoad, m: RankMemory) -> None:
        """The unsharded copies a rank holds at its peak are parameters (MemTracker's PARAM): with
        resharding the stage's root unit (embedding, final norm, head: FSDP2 never reshards the root)
        and the block being re-gathered for its backward; without, the whole stage. ZeRO-1/2 hold
        theirs (`strategies.zero`)."""
        plan = step.plan
        if step.fs > 1 and not getattr(plan, "zero", 0):
            from dtorch.plan.strategies.memory import (
                dense_loss_moment_peaks,
                loss_moment_peaks,
                root_unit_params,
            )

            if loss_moment_peaks(step, load):  # (a MoE rank peaking at the loss: the root unit only)
                root = root_unit_params(step, load)
                m.states["params"] = m.states.get("params", 0.0) + root * step.param_b
                return
            m.states["params"] = m.states.get("params", 0.0) + self.gathered(step, load, m.p_gathered)
            if (plan.pp == 1 and (plan.reshard_after_forward or plan.offload == "params")
                    and not dense_loss_moment_peaks(step, load)):
                # the peak is the last block's re-gather, after the head's backward made the root
                # unit's unsharded gradients (reduce-scattered with the root's, last); at the loss's
                # moment there are none yet
                root = root_unit_params(step, load)
                m.states["grads"] = m.states.get("grads", 0.0) + root * step.param_b

    def gathered(self, step: StepShape, load: RankLoad, p_stage: float) -> float:
        """Bytes of unsharded parameters at the rank's peak; `p_stage`: the stage's parameters as a
        rank gathers them (with EP its own routed experts only, `Expert.gathered_stage_params`)."""
        plan, prof = step.plan, step.profile
        if not (plan.reshard_after_forward or plan.offload == "params"):
            return p_stage * step.param_b  # the whole stage stays gathered from forward to backward
        from dtorch.plan.strategies.memory import root_unit_params

        return (root_unit_params(step, load) + held_block_params(prof, plan)) * step.param_b

    def buffers(self, step: StepShape, p_stage: float) -> float:
        """Bytes of gathered parameters and gradient staging; `p_stage`: the stage's parameters as a
        rank gathers them (with EP its own routed experts only, `Expert.gathered_stage_params`)."""
        plan = step.plan
        if step.fs == 1:
            return 0.0
        p_block = gathered_block_params(step.profile, plan)
        if plan.reshard_after_forward or plan.offload == "params":
            return 2 * p_block * step.param_b + p_block * step.red_b  # gathered block + prefetch, one grad block
        return p_stage * step.param_b + p_block * step.red_b  # whole stage stays gathered fwd -> bwd


FSDP = Sharded()
