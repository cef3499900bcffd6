"""torch.compile per repeated block: the plan's `compile` field, declared here (not in plan.py).

Executor half: `dtorch.parallel.compile` (each block compiled after TP, CP and AC, before FSDP;
`check_compile` refuses what it cannot compile before any process group exists).

Rules and limits mirror the executor's refusals, so the search never ranks a plan the executor
refuses: activation checkpointing together with tensor parallelism is a `Limit` (torch 2.13's AOT
autograd fails on the checkpointed DTensor block). The executor's two other refusals depend on what
the planner does not see: dropout > 0 in tensor-parallel blocks (the model profile carries no
dropout) and a missing compiler on the machine that runs (a C++ compiler on CPU, Triton on CUDA);
a calibrated speed-up (below) was measured on a machine that had the compiler.

Time: `prepare` and `rank_time` (cost.py reads no compile field). Where the cluster's calibration
holds a measured speed-up for the plan's family (``calibration["compile"]["by_family"][family]``,
any measured ratio, a slow-down too), the rank's per-micro-batch compute, recompute and host
seconds are divided by it: the measurement is of whole steps whose communication and optimizer
compile does not change, so the part compile does change sped up by at least that much (a
conservative transfer to other models of the family). Where none was measured (only ``--fix
compile=true`` sets it then, and published runs that compiled), the cost model's own guess prices
it: the element-wise passes fused down to `CostConstants.compile_elementwise_factor` of eager.

Compile seconds (`once_s`: the calibrated ``compile_s``, paid once at the first step) are not in
the step time. With the run's length known (`dtorch plan --steps N`, the trainer's `fit(steps)`)
the search ranks by the amortised time (step_time x steps + compile_s) / steps and the
explanation shows it; without one they are only reported beside the estimate (`notes`).

Candidates: `compile=True` is offered only where the cluster's calibration holds a measured
speed-up above 1 for the plan's family (``calibration["compile"]["by_family"][family]``, written by
`dtorch.parallel.compile.record_measurement`, benchmarks/bench_compile.py); otherwise only
``--fix compile=true`` sets it. No plan is ranked by a speed-up nobody measured on the machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dtorch.cluster.spec import Cluster
from dtorch.plan.step import RankLoad, RankShare, StepCounts, StepShape
from dtorch.plan.strategies.base import Dims, Field, Limit, Strategy, Violation

RECORD_KEY = "compile"
"""The calibration section `dtorch.parallel.compile.record_measurement` writes."""


def measurement(calibration: dict | None, family: str) -> dict | None:
    """The calibrated compile record of plan family `family` ({speedup, compile_s, samples}) when it
    holds a measured speed-up (a positive eager / compiled ratio, a slow-down included), else None."""
    rec = ((calibration or {}).get(RECORD_KEY) or {}).get("by_family") or {}
    fam = rec.get(family)
    if not isinstance(fam, dict):
        return None
    speedup = fam.get("speedup")
    ok = isinstance(speedup, (int, float)) and not isinstance(speedup, bool) and speedup > 0
    return fam if ok else None


def measured(calibration: dict | None, family: str) -> dict | None:
    """The calibrated compile record of plan family `family` when it holds a speed-up above 1, else None."""
    fam = measurement(calibration, family)
    return fam if fam is not None and fam["speedup"] > 1.0 else None


@dataclass(frozen=True, slots=True)
class CompileGain:
    """The compile strategy's per-plan term (`Compile.prepare`): the measured speed-up it applies."""

    speedup: float


class Compile(Strategy):
    name = "compile"
    executor = "dtorch.parallel.compile"
    fields = (Field("compile", "bool", plan_type="bool", default=False,
                    doc="Compile each repeated block with torch.compile (dtorch/parallel/compile.py)."),)

    def rules(self, plan: Any, dims: Dims | None) -> Iterator[Violation]:
        if dims is None and not isinstance(plan.compile, bool):
            yield Violation("compile", plan.compile, "use true or false")

    def limits(self, plan: Any) -> Iterator[Limit]:
        if plan.compile and plan.tp > 1 and plan.ac != "none":
            yield Limit("torch.compile of an activation-checkpointed tensor-parallel block fails in torch 2.13's "
                        "AOT autograd", "compile", True, "use ac=none, or compile=false, or tp=1")

    def describe(self, plan: Any):
        if plan.compile:
            yield 65, "compile"

    # ---- time ----------------------------------------------------------------------------------------
    def prepare(self, step: StepShape) -> bool:
        """A compiled plan's price (module doc): True where a measured speed-up for the plan's family
        is in the cluster's calibration (`rank_time` applies it); otherwise the fused element-wise
        passes of the cost model, and nothing for `rank_time`."""
        if not step.plan.compile:
            return False
        rec = measurement(getattr(getattr(step, "cluster", None), "calibration", None), step.plan.family())
        if rec is not None:
            return step.keep(CompileGain(float(rec["speedup"])))
        if not step.compiled:  # (already priced so when the caller describes a published compiled run)
            step.compiled = True
            step.elem_s_per_byte *= step.c.compile_elementwise_factor
        return False

    def rank_time(self, step: StepShape, load: RankLoad, r: RankShare, counts: StepCounts) -> None:
        """Divide the rank's compute, recompute and host seconds per micro-batch by the measured speed-up."""
        s = step.term(CompileGain).speedup
        r.compute, r.recompute, r.host = r.compute / s, r.recompute / s, r.host / s

    def once_s(self, plan: Any, cluster: Cluster) -> float:
        """The calibrated compile seconds of `plan`'s family (0 when not compiled or not measured)."""
        rec = measurement(getattr(cluster, "calibration", None), plan.family()) if plan.compile else None
        return float(rec.get("compile_s") or 0.0) if rec is not None else 0.0

    # ---- search candidates -------------------------------------------------------------------------
    def candidates(self, plan: Any, fixed: dict[str, Any], calibration: dict | None) -> list[bool]:
        """The `compile` values the search tries for `plan`: the fixed one, else False, and True
        where the calibration measured a gain for the plan's family and the executor can run it."""
        if "compile" in fixed:
            return [fixed["compile"]]
        on = dataclasses.replace(plan, compile=True)
        if measured(calibration, plan.family()) is None or next(self.limits(on), None) is not None:
            return [False]
        return [False, True]

    def variants(self, plan: Any, fixed: dict[str, Any], cluster: Cluster) -> list[Any]:
        if plan.compile or True not in self.candidates(plan, fixed, getattr(cluster, "calibration", None)):
            return []
        return [dataclasses.replace(plan, compile=True)]

    def notes(self, plan: Any, cluster: Cluster) -> Iterator[str]:
        if not plan.compile:
            return
        rec = measurement(getattr(cluster, "calibration", None), plan.family())
        if rec is None:
            yield ("compile=true: no compile measurement in this cluster's calibration, so its gain is the cost "
                   "model's (fused element-wise work) and its compile seconds (paid at the first step) unknown; "
                   "measure with benchmarks/bench_compile.py")
        else:
            yield (f"compile=true ({plan.family()}): priced by the measured speed-up {rec['speedup']:.2f}x "
                   f"({rec.get('samples', 0)} measurement(s)); about {rec.get('compile_s', 0.0):.0f} s of "
                   f"compilation at the first step, not in the step time (amortised in the ranking when the run "
                   f"length is given: --steps N)")


COMPILE = Compile()
