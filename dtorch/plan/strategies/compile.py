"""torch.compile per repeated block: the plan's `compile` field, declared here (not in plan.py).

Executor half: `dtorch.parallel.compile` (each block compiled after TP, CP and AC, before FSDP;
`check_compile` refuses what it cannot compile before any process group exists).

Rules and limits mirror the executor's refusals, so the search never ranks a plan the executor
refuses: activation checkpointing together with tensor parallelism is a `Limit` (torch 2.13's AOT
autograd fails on the checkpointed DTensor block). The executor's two other refusals depend on what
the planner does not see: dropout > 0 in tensor-parallel blocks (the model profile carries no
dropout) and a missing compiler on the machine that runs (a C++ compiler on CPU, Triton on CUDA);
a calibrated speed-up (below) was measured on a machine that had the compiler.

Time: no term of its own. The step shape prices compiled element-wise work
(`CostConstants.compile_elementwise_factor`) when `plan.compile` is set (`cost.step_shape` reads
``compiled or plan.compile``). The compile seconds are paid once, at the first step; the planner
does not know a run's length, so they are reported beside the estimate (`notes`) from the
cluster's calibration, not put into the step time.

Candidates: `compile=True` is offered only where the cluster's calibration holds a measured
speed-up above 1 for the plan's family (``calibration["compile"]["by_family"][family]``, written by
`dtorch.parallel.compile.record_measurement`, benchmarks/bench_compile.py); otherwise only
``--fix compile=true`` sets it. No plan is ranked by a speed-up nobody measured on the machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from dtorch.plan.strategies.base import Dims, Field, Limit, Strategy, Violation

RECORD_KEY = "compile"
"""The calibration section `dtorch.parallel.compile.record_measurement` writes."""


def measured(calibration: dict | None, family: str) -> dict | None:
    """The calibrated compile record of plan family `family` ({speedup, compile_s, samples}) when
    it holds a speed-up above 1, else None."""
    rec = ((calibration or {}).get(RECORD_KEY) or {}).get("by_family") or {}
    fam = rec.get(family)
    if not isinstance(fam, dict):
        return None
    speedup = fam.get("speedup")
    return fam if isinstance(speedup, (int, float)) and speedup > 1.0 else None


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

    def variants(self, plan: Any, fixed: dict[str, Any], cluster: Any) -> list[Any]:
        if plan.compile or True not in self.candidates(plan, fixed, getattr(cluster, "calibration", None)):
            return []
        return [dataclasses.replace(plan, compile=True)]

    def notes(self, plan: Any, cluster: Any) -> Iterator[str]:
        if not plan.compile:
            return
        rec = measured(getattr(cluster, "calibration", None), plan.family())
        if rec is None:
            yield ("compile=true: no compile measurement in this cluster's calibration, so its gain is the cost "
                   "model's and its compile seconds (paid at the first step) unknown; "
                   "measure with benchmarks/bench_compile.py")
        else:
            yield (f"compile=true ({plan.family()}): about {rec.get('compile_s', 0.0):.0f} s of compilation at the "
                   f"first step, not in the step time (calibrated, {rec.get('samples', 0)} measurement(s), "
                   f"measured speed-up {rec['speedup']:.2f}x)")


COMPILE = Compile()
