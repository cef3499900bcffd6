"""Memory policies: activation checkpointing (`ac`: none, selective, full) and offload (`offload`:
none, optimizer states, or FSDP's CPU offload of parameters, gradients and optimizer states).

Executor halves: `dtorch.parallel.ac` (checkpoint wrappers per block) and `dtorch.parallel.fsdp`
(CPUOffloadPolicy).

Time: full AC repeats each block's forward, 1/3 of its training FLOPs (Korthikanti et al. 2022);
selective AC repeats the attention core only, 4 h s per token per block (section 5). Offload moves
the optimizer step to the CPU (`cpu_adam_bytes_per_s`) and its states over the host link, and with
parameters offloaded every gather and reduction too. Memory: activations per block by policy from
the profile (Korthikanti Table 2 shapes); full AC re-materialises one block during its backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dtorch.errors import choices
from dtorch.plan.strategies.base import Dims, Field, Limit, RankLoad, RankShare, Strategy, Violation

AC_POLICIES = ("none", "selective", "full")
OFFLOAD_POLICIES = ("none", "optimizer", "params")
LADDER = [("none", False), ("none", True), ("selective", False), ("selective", True), ("full", False), ("full", True)]
"""(ac, reshard_after_forward) in order of cost: more recomputation or more traffic is never faster."""


class Memory(Strategy):
    name = "memory"
    executor = "dtorch.parallel.ac"
    fields = (
        Field("ac", "choice", AC_POLICIES),
        Field("offload", "choice", OFFLOAD_POLICIES),
    )

    def rules(self, plan: Any, dims: Dims | None) -> Iterator[Violation]:
        if plan.ac not in AC_POLICIES:
            yield Violation("ac", plan.ac, choices(AC_POLICIES))
        if plan.offload not in OFFLOAD_POLICIES:
            yield Violation("offload", plan.offload, choices(OFFLOAD_POLICIES))

    def limits(self, plan: Any) -> Iterator[Limit]:
        if plan.offload == "optimizer":
            yield Limit("optimizer-state offload (ZeRO-Offload) is not implemented by this executor; "
                        "offload=params (FSDP2 CPU offload) is", "offload", plan.offload,
                        "use offload=params (with dp_shard > 1) or none")

    def describe(self, plan: Any):
        if plan.ac != "none":
            yield 30, f"ac={plan.ac}"
        if plan.offload != "none":
            yield 40, f"offload={plan.offload}"

    # ---- search candidates ---------------------------------------------------------------------
    def offloads(self, dp_shard: int, fixed: dict[str, Any]) -> list[str]:
        """Offload levels to try, in order (each only where the one before fits nothing)."""
        out = [fixed["offload"]] if "offload" in fixed else list(OFFLOAD_POLICIES)
        if dp_shard == 1 and "offload" not in fixed:
            out.remove("params")  # CPU offload of parameters is an FSDP feature
        return out

    def rungs(self, dp_shard: int, fixed: dict[str, Any]) -> list[tuple[str, bool]]:
        """The checkpointing/resharding ladder for a mesh, cheapest first."""
        out = []
        for ac, reshard in LADDER:
            if "ac" in fixed and fixed["ac"] != ac:
                continue
            if dp_shard == 1:
                if reshard:
                    continue  # nothing to reshard without FSDP
            elif "reshard_after_forward" in fixed and fixed["reshard_after_forward"] != reshard:
                continue
            out.append((ac, reshard))
        return out

    # ---- time and memory -----------------------------------------------------------------------
    def recompute(self, step: Any, load: RankLoad, r: RankShare, flops_mb: float) -> None:
        """Seconds of recomputation per micro-batch (after `r.compute` is known)."""
        plan = step.plan
        div = plan.tp * plan.cp
        if plan.ac == "full":
            rec_flops = step.tokens_mb * load.blocks * step.profile.flops_per_token_block / 3.0 / div
            r.recompute = r.compute * (rec_flops / flops_mb) if flops_mb else 0.0
        elif plan.ac == "selective":
            r.recompute = step.tokens_mb * load.blocks * step.attn_fwd / div / step.speed

    def prepare(self, step: Any) -> bool:
        return step.plan.offload != "none"

    def rank_time(self, step: Any, load: RankLoad, r: RankShare, counts: Any) -> None:
        plan, c = step.plan, step.c
        p_local = r.p_stage / step.fs
        m, pb, rb = plan.num_microbatches, step.param_b, step.red_b
        r.offload = p_local * c.optimizer_bytes_per_param / c.cpu_adam_bytes_per_s
        r.offload += p_local * (rb + pb) / c.host_link_bandwidth  # grads down, params up
        if plan.offload == "params":
            n_ag = m * (2 if plan.reshard_after_forward else 1) if plan.pp == 1 else m * plan.virtual_stages * 2
            r.offload += n_ag * p_local * pb / c.host_link_bandwidth
            r.offload += m * p_local * rb / c.host_link_bandwidth

    def host_bytes(self, plan: Any, p_local: float) -> float:
        """Host memory of one rank's offloaded states (ZeRO-Offload: fp32 master params + Adam
        moments, plus fp32 grads when parameters are offloaded too)."""
        return 12.0 * p_local if plan.offload == "optimizer" else (16.0 * p_local if plan.offload == "params" else 0.0)


MEMORY = Memory()
