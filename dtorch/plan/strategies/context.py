"""Context parallelism: the sequence split over `cp` ranks inside attention (Llama 3's all-gather
form: K and V all-gathered before attention, load-balanced into 2*cp chunks).

Executor half: `dtorch.parallel.cp`.

Time: K and V all-gathered forward (again when full AC recomputes), their gradients reduce-scattered
in backward; issued before attention, so exposed; latency as the probe timed a functional collective,
and a wait for the slowest peer (`Link.skew`). The GEMM rows of a rank are the
micro-batch's tokens / cp (the step shape's `rows`); FSDP shards over dp_shard x cp.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dtorch.plan.comm import functional_time, sync_skew
from dtorch.plan.step import StepShape
from dtorch.plan.strategies.base import Dims, Field, Limit, RankLoad, RankShare, Strategy, Violation, divisors
from dtorch.plan.strategies.memory import recompute_reruns_collectives

MAX_CP = 64
"""The largest context-parallel degree the search tries."""


@dataclass(frozen=True, slots=True)
class KvGather:
    """Context parallelism's per-plan term (`Context.prepare`): seconds of one K/V all-gather over cp."""

    kv_s: float


class Context(Strategy):
    name = "context"
    executor = "dtorch.parallel.cp"
    fields = (Field("cp", "degree", mesh_position=3),)
    family_fields = ("cp",)
    refusal_fields = ("cp",)

    def unsupported_for(self, profile: Any) -> str | None:
        if profile.context_reason:
            return profile.context_reason
        if profile.input_kind != "tokens":
            return "the model's input is not a token sequence (context parallelism splits the sequence)"
        if not profile.num_heads:
            return "no attention found (context parallelism splits attention over the sequence)"
        return None

    def rules(self, plan: Any, dims: Dims | None) -> Iterator[Violation]:
        if dims is None or dims.seq_len is None or plan.cp == 1:
            return
        unit = 2 * plan.cp * plan.tp
        if dims.seq_len % unit:
            yield Violation(dims.seq_field or "cp", dims.seq_len if dims.seq_field else plan.cp,
                            f"context parallel splits the sequence into tp*2*cp = {unit} load-balanced chunks, "
                            f"but seq_len {dims.seq_len} is not divisible by 2*cp*tp = {unit}; "
                            f"use a multiple of {unit} (or a cp whose 2*cp*tp divides it)")

    def limits(self, plan: Any) -> Iterator[Limit]:
        if plan.cp > 1 and plan.pp > 1:
            # not built: the pipeline schedule would need sequence-sharded micro-batches and stage shapes
            yield Limit("context parallelism with pipeline parallelism is not implemented by this executor",
                        "cp", plan.cp, "use cp=1 or pp=1")

    def family(self, plan: Any) -> str | None:
        return "CP" if plan.cp > 1 else None

    def degrees(self, rest: int, seq_len: int, tp: int) -> list[int]:
        return [c for c in divisors(rest) if c <= MAX_CP and seq_len % (2 * c * tp) == 0 or c == 1]

    def prepare(self, step: StepShape) -> bool:
        plan = step.plan
        if plan.cp == 1:
            return False
        kv_dim = step.h * step.profile.num_kv_heads / step.profile.num_heads
        kv_bytes = 2.0 * step.tokens_mb * kv_dim * step.act_b / plan.tp
        return step.keep(KvGather(functional_time("all_gather", kv_bytes, plan.cp, step.st_cp, step.g)))

    def blocking_collectives(self, step: StepShape, load: RankLoad, counts: Any) -> float:
        # K and V all-gathered forward (once more when full AC recomputes the block), their gradients
        # reduce-scattered in backward (the gathered K/V are saved for it); the executor issues them
        # before attention, so nothing hides them (dtorch/parallel/cp.py)
        return load.blocks * (2 + (1 if recompute_reruns_collectives(step.plan.ac, step.selective) else 0))

    def rank_time(self, step: StepShape, load: RankLoad, r: RankShare, counts: Any) -> None:
        n = self.blocking_collectives(step, load, counts)
        inside = step.st_cp * step.plan.cp <= step.g.devices_per_node
        # each exchange also waits for the slowest peer after the stretch of work since the last one
        r.cp = n * (step.term(KvGather).kv_s + sync_skew(step.g.intra if inside else step.g.inter, r.segment_s(),
                                      step.plan.cp))


CONTEXT = Context()
