"""What the executor of this DTorch version can run: the planner ranks only such plans.

This is data about `dtorch.parallel` kept in the planner's room (the planner must not import the
executor); `dtorch.parallel.check` enforces the same list before any process group exists.
"""

from __future__ import annotations

from dtorch.plan.plan import Plan


def unsupported_dtype(dtype: str) -> str | None:
    """Why this executor cannot train with parameters computed in `dtype`, or None if it can."""
    if dtype == "float16":
        # float16's 5-bit exponent underflows small gradients to zero unless the loss is scaled (and
        # steps with inf/nan gradients skipped); this executor does not scale the loss
        return "float16 training needs loss scaling, which this executor does not apply; use bfloat16"
    return None


def unsupported(plan: Plan) -> str | None:
    """Why `plan` cannot run on this executor (torch 2.13), or None if it can."""
    for name in ("param_dtype", "reduce_dtype"):
        why = unsupported_dtype(getattr(plan, name))
        if why:
            return f"{name}={getattr(plan, name)}: {why}"
    if plan.cp > 1 and plan.pp > 1:
        # not built: the pipeline schedule would need sequence-sharded micro-batches and stage shapes
        return "context parallelism with pipeline parallelism is not implemented by this executor"
    if plan.offload == "optimizer":
        return ("optimizer-state offload (ZeRO-Offload) is not implemented by this executor; "
                "offload=params (FSDP2 CPU offload) is")
    if plan.pp > 1 and plan.schedule == "zero_bubble" and plan.ac == "selective":
        # zero-bubble runs a stage's backward in two passes (input, then weight gradients); torch's
        # selective checkpointing allows one backward per recomputed region ("Trying to backward an
        # extra time"), seen on a 2-worker gloo job re-planned after an OOM
        return "zero-bubble with selective activation checkpointing fails in torch 2.13; use ac=full or another schedule"
    if plan.pp > 1 and plan.schedule == "zero_bubble" and plan.sp and plan.num_stages > 2:
        # the split input/weight backward of a middle stage fails on the sequence-parallel boundary
        # ("Can't detach views in-place"), measured on gloo with pp=2, v=2
        return "zero-bubble with sequence parallelism and middle pipeline stages fails in torch 2.13"
    return None
