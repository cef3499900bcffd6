"""Precision: the dtype parameters are computed in (`param_dtype`, mixed precision with float32
master weights) and the dtype gradients are reduced in (`reduce_dtype`).

Executor half: `dtorch.parallel.model` (FSDP2 MixedPrecisionPolicy, or autocast without sharding).

Time: compute at the device's peak for the dtype; activations and element-wise bytes scale with
its width (the step shape's `act_b`); collectives move `param_b` / `red_b` bytes per element.
Memory: under autocast (no FSDP to cast the parameters) a copy of every matmul weight in param_dtype
is held through the step (`Precision.rank_memory`); FSDP2's casts are its gathered copies
(`strategies.fsdp`, `strategies.data`).
Ranking: a plan computing or reducing in less than float32 must be PRECISION_MARGIN faster than the
best plan at higher precision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from dtorch.cluster.spec import Cluster, DeviceType
from dtorch.errors import choices
from dtorch.plan.step import RankLoad, RankMemory, StepShape
from dtorch.plan.strategies.base import Dims, Field, Limit, Strategy, Violation

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = (("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"), ("half", "float16"))
_FLOAT8 = (("float8", "float8 training is not implemented by this executor; use bfloat16 or float32"),
           ("fp8", "float8 training is not implemented by this executor; use bfloat16 or float32"))
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
PRECISION_MARGIN = 0.03
"""A plan computing or reducing in less than float32 must be this much faster than the best plan at
higher precision to be ranked above it: numerics are worth a few per cent of speed."""


def unsupported_dtype(dtype: str) -> str | None:
    """Why this executor cannot train with parameters computed in `dtype`, or None if it can."""
    if dtype == "float16":
        # float16's 5-bit exponent underflows small gradients to zero unless the loss is scaled (and
        # steps with inf/nan gradients skipped); this executor does not scale the loss
        return "float16 training needs loss scaling, which this executor does not apply; use bfloat16"
    return None


class Precision(Strategy):
    name = "precision"
    executor = "dtorch.parallel.model"
    fields = (
        Field("param_dtype", "choice", DTYPES, aliases=("dtype", "precision"), value_aliases=DTYPE_ALIASES,
              refuse=_FLOAT8),
        Field("reduce_dtype", "choice", DTYPES, value_aliases=DTYPE_ALIASES, refuse=_FLOAT8),
    )

    def rules(self, plan: Any, dims: Dims | None) -> Iterator[Violation]:
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(plan, name) not in DTYPES:
                yield Violation(name, getattr(plan, name), choices(DTYPES))

    def limits(self, plan: Any) -> Iterator[Limit]:
        for name in ("param_dtype", "reduce_dtype"):
            why = unsupported_dtype(getattr(plan, name))
            if why:
                yield Limit(f"{name}={getattr(plan, name)}: {why}", name, getattr(plan, name),
                            "use bfloat16 (the same range as float32, no scaling needed) or float32")

    def describe(self, plan: Any):
        if (plan.param_dtype, plan.reduce_dtype) != ("float32", "float32"):
            yield 70, f"{SHORT[plan.param_dtype]}" + (f"/reduce-{SHORT[plan.reduce_dtype]}"
                                                       if plan.reduce_dtype != "float32" else "")

    # ---- search candidates and ranking ---------------------------------------------------------
    def candidates(self, dev: DeviceType, fixed: dict[str, Any]) -> tuple[list[tuple[str, str]], list[str]]:
        """(param_dtype, reduce_dtype) pairs worth searching on device `dev`, and why others were left
        out. A 16-bit dtype is a candidate where the device has it (emulation is priced by its measured
        or detected peak, so an emulated one loses on its own) and this executor can train in it
        (float16 needs loss scaling). Where a 16-bit peak is at least 4x float32's on a GPU, float32
        cannot win (more time, more activation memory) and is not evaluated. Gradients reduce in
        float32 here; `variants` tries the compute dtype on the plans that made the ranking."""
        notes: list[str] = []
        if "param_dtype" in fixed:
            params = [fixed["param_dtype"]]
        else:
            params = []
            for d in DTYPES:
                if not dev.supports(d):
                    continue
                why = unsupported_dtype(d)
                if why:
                    if d != "float16" or not dev.supports("bfloat16"):
                        notes.append(f"{d} not searched: {why}")
                    continue
                params.append(d)
            fast = [d for d in params if d != "float32" and dev.peak(d) >= 4.0 * dev.peak("float32")]
            if fast and dev.kind != "cpu" and "float32" in params:
                params.remove("float32")
                notes.append(f"float32 not searched: {fast[0]}'s peak is {dev.peak(fast[0]) / dev.peak('float32'):.0f}x "
                             f"float32's on {dev.name}")
        red = fixed.get("reduce_dtype", "float32")
        return [(p, red) for p in params], notes

    def variants(self, plan: Any, fixed: dict[str, Any], cluster: Cluster | None = None) -> list[Any]:
        """Variants of a fitting plan that reduce gradients in its 16-bit compute dtype. Reduction
        precision changes only communication (and a little buffer memory), so the search tries it on
        the plans that made the ranking rather than on every plan."""
        if "reduce_dtype" in fixed or plan.param_dtype == "float32" or plan.reduce_dtype == plan.param_dtype:
            return []
        if plan.dp_shard * plan.cp == 1 and plan.dp_replicate == 1:
            return []  # no gradient reduction to make cheaper
        return [dataclasses.replace(plan, reduce_dtype=plan.param_dtype)]

    def penalty(self, plan: Any) -> float:
        return 1.0 + PRECISION_MARGIN * ((plan.param_dtype != "float32") + (plan.reduce_dtype != "float32"))

    # ---- memory ----------------------------------------------------------------------------------
    def rank_memory(self, step: StepShape, load: RankLoad, m: RankMemory) -> None:
        """Autocast's copies of the weights in param_dtype are parameters (MemTracker's PARAM, as
        FSDP2's gathered copies are), `param_b` bytes per local weight of the matmuls: where the
        executor computes by autocast (`step.autocast`: single device, TP, PP, classic DDP),
        each matmul casts its float32 weight (and bias) and autocast's cast cache keeps the copy
        until the step's autocast context ends, after the last micro-batch's backward: alive at
        every moment of the step, once per step whatever the micro-batch count (without the cache
        autograd would save one per micro-batch in flight for the backward). Embeddings and norms
        are not cast."""
        if step.autocast:
            m.states["params"] = m.states.get("params", 0.0) + cast_params(step, load) * step.param_b


def cast_params(step: StepShape, load: RankLoad) -> float:
    """Weights of pipeline rank `load` per TP rank that autocast casts: its blocks' parameters but
    their two norms', and the head's matmul weight (the embedding's, when tied)."""
    from dtorch.plan.step import _block_params

    prof = step.profile
    head_matmul = float(prof.vocab_size) * prof.hidden
    norm = max(0.0, prof.params_head - (0.0 if prof.tied_embeddings else head_matmul))  # (the final norm's)
    blocks = _block_params(load, prof) - 2.0 * norm * load.blocks
    return (blocks + head_matmul * load.head) / step.plan.tp


PRECISION = Precision()
